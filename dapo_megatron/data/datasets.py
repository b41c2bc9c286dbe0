"""Prompt data sets for DAPO training and evaluation: reading, cleaning, tokenizing, resumable order.

Files
    ``.jsonl`` (one JSON object per line; blank lines are ignored) and ``.parquet``. Rows are
    numbered like an editor does for jsonl (line 1 is the first line) and from 0 for parquet (the
    index pandas and pyarrow show), and every error names the file and that number.

Formats (``format="auto"`` picks one per file from the first row that matches a rule below, in
this order; pass ``format=`` to force one)
    ``verl``   ``prompt`` is a list of chat messages ``[{"role": "user", "content": ...}]`` and the
               answer is ``reward_model.ground_truth`` (DAPO-Math-17k, DAPO's AIME parquet).
    ``gsm8k``  ``question`` plus an ``answer`` solution that contains ``#### N``; the ground truth is
               ``N`` without thousands separators, and the question is wrapped in DAPO's prompt.
    ``flat``   one text field and one answer field. ``prompt`` is used verbatim (it is already the
               full prompt); ``problem`` or ``question`` is a bare problem and is wrapped in DAPO's
               prompt. The answer is ``ground_truth`` or ``answer`` (a string or an integer).
    A ``data_source`` field, when present, is kept (it selects the reward function); rows without
    one get ``gsm8k`` for the gsm8k format and ``math_dapo`` otherwise (the prompt asks for DAPO's
    ``Answer:`` line, which DAPO's scorer grades). ``data_source=`` overrides every row.

De-duplication
    Two prompts are the same when their messages (role and content) are equal after Unicode NFC
    normalisation, collapsing whitespace runs and stripping; case is kept because it matters in
    math. The first occurrence is kept, in file order. The ``uid`` is a hash of that normalised
    text, so it is stable across runs, file orderings and machines; with de-duplication off, the
    k-th repeat of a prompt gets ``<hash>-k`` so that uids stay unique (rollout groups are keyed by
    them).

Tokens
    :func:`encode_prompt` renders the messages with the tokenizer's chat template and
    ``add_generation_prompt=True`` when ``tokenizer.chat_template`` is set; otherwise the message
    contents joined by a blank line are tokenized as plain text. Prompts over ``max_prompt_length``
    tokens are truncated from the left (DAPO, via verl's ``truncation=left``), dropped, or raise,
    and :class:`DatasetStats` counts each case.

Order
    :class:`PromptDataset` hands out batches in a per-epoch shuffle that is a pure function of
    ``(seed, epoch)``, so its position is three integers (:meth:`PromptDataset.state_dict`) and a
    resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, overload

from dapo_megatron.data.config import FORMATS, OVERLONG_MODES
from dapo_megatron.records import PromptExample

if TYPE_CHECKING:
    from dapo_megatron.data.config import DataConfig

__all__ = [
    "DAPO_INSTRUCTION",
    "DAPO_REMINDER",
    "DatasetError",
    "DatasetStats",
    "PromptDataset",
    "PromptTokenizer",
    "build_dataset",
    "dapo_prompt",
    "dataset_from_config",
    "detect_format",
    "encode_prompt",
    "load_examples",
    "render_prompt",
    "to_verl_row",
    "tokenize_examples",
]

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
DAPO_REMINDER = 'Remember to put your answer on its own line after "Answer:".'
DEFAULT_DATA_SOURCE = "math_dapo"
GSM8K_DATA_SOURCE = "gsm8k"

_GSM8K_MARKER = "####"
_NUMBER_WITH_SEPARATORS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_MAX_KEPT_ERRORS = 5  # malformed-row messages kept in the stats, enough to see the pattern


def dapo_prompt(problem: str) -> str:
    """DAPO's training and AIME prompt around a bare problem statement."""
    return f"{DAPO_INSTRUCTION}\n\n{problem}\n\n{DAPO_REMINDER}"


class DatasetError(ValueError):
    """A data file or row that cannot be used; the message names the file, the row and the fix."""

    def __init__(self, message: str, *, path: Path | str | None = None, row: int | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.row = row
        """1-based line for jsonl, 0-based row index for parquet, None for whole-file problems."""


class _RowProblem(Exception):
    """What is wrong with one row; turned into a DatasetError once the row's location is known."""


@dataclass
class DatasetStats:
    """What loading did to the rows, for the trainer to log."""

    files: list[str] = field(default_factory=list)
    rows_read: int = 0
    malformed_skipped: int = 0
    duplicates_removed: int = 0
    conflicting_duplicates: int = 0
    """Removed duplicates whose ground truth differed from the kept row's (a data quality warning)."""
    too_long_dropped: int = 0
    too_long_truncated: int = 0
    longest_prompt_tokens: int = 0
    """Longest prompt seen before truncation; helps to choose max_prompt_length."""
    final_size: int = 0
    malformed_examples: list[str] = field(default_factory=list)
    """The first few skipped rows' error messages."""

    def record_malformed(self, error: DatasetError) -> None:
        self.malformed_skipped += 1
        if len(self.malformed_examples) < _MAX_KEPT_ERRORS:
            self.malformed_examples.append(str(error))

    def as_metrics(self) -> dict[str, int]:
        """The counters, for TensorBoard or a JSON summary."""
        names = (
            "rows_read",
            "malformed_skipped",
            "duplicates_removed",
            "conflicting_duplicates",
            "too_long_dropped",
            "too_long_truncated",
            "longest_prompt_tokens",
            "final_size",
        )
        return {name: getattr(self, name) for name in names}

    def summary(self) -> str:
        """One log line, e.g. ``960 rows read, 930 duplicates removed, ... -> 30 prompts``."""
        parts = [f"{self.rows_read} rows read from {len(self.files)} file(s)"]
        optional = (
            ("malformed rows skipped", self.malformed_skipped),
            ("duplicates removed", self.duplicates_removed),
            ("duplicates with a different ground truth", self.conflicting_duplicates),
            ("too long and dropped", self.too_long_dropped),
            ("too long and left-truncated", self.too_long_truncated),
        )
        parts += [f"{count} {label}" for label, count in optional if count]
        if self.longest_prompt_tokens:
            parts.append(f"longest prompt {self.longest_prompt_tokens} tokens")
        return ", ".join(parts) + f" -> {self.final_size} prompts"


# ----------------------------------------------------------------------------------------------------
# Reading rows
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _JsonLine:
    """An undecoded jsonl line: decoding happens per row so a bad line can be skipped and counted."""

    data: bytes


def _jsonl_rows(path: Path) -> Iterator[tuple[int, _JsonLine]]:
    try:
        with path.open("rb") as handle:
            for line_number, data in enumerate(handle, start=1):
                if data.strip():
                    yield line_number, _JsonLine(data)
    except OSError as error:
        raise DatasetError(f"{path}: cannot read the file ({error}).", path=path) from error


def _parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = 0
    try:
        # Streamed in batches: the public DAPO-Math-17k parquet has 1.79M rows, ~99% duplicates,
        # and only the unique ones should ever be held in memory.
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                yield index, row
                index += 1
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(
            f"{path}: cannot read parquet data after row {index} ({error}). "
            "Fix: re-download or re-create the file (tools/prepare_data.py).",
            path=path,
        ) from error


_READERS: dict[str, tuple[Callable[[Path], Iterator[tuple[int, object]]], str]] = {
    ".jsonl": (_jsonl_rows, "line"),
    ".parquet": (_parquet_rows, "row"),
}


def _check_file(path: Path) -> None:
    if not path.exists():
        raise DatasetError(
            f"{path}: no such file (relative paths start at {Path.cwd()}). Fix: correct the "
            "path, or download the public data sets with tools/prepare_data.py.",
            path=path,
        )
    if not path.is_file():
        raise DatasetError(f"{path}: is not a file; list the data files themselves.", path=path)
    if path.suffix not in _READERS:
        raise DatasetError(
            f"{path}: unsupported file type {path.suffix!r}; expected one of {sorted(_READERS)}.", path=path
        )


def _as_object(payload: object) -> Mapping[str, Any]:
    if isinstance(payload, _JsonLine):
        try:
            payload = json.loads(payload.data.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise _RowProblem(f"is not UTF-8 text ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            raise _RowProblem(
                f"is not valid JSON ({error.msg} at column {error.colno}); each line of a "
                ".jsonl file must be one complete JSON object"
            ) from None
        except (ValueError, RecursionError) as error:  # a number of over 4300 digits, absurd nesting
            raise _RowProblem(f"cannot be decoded as JSON ({error})") from None
    if not isinstance(payload, Mapping):
        raise _RowProblem(f"is a JSON {type(payload).__name__}, not an object with named fields")
    return payload


# ----------------------------------------------------------------------------------------------------
# Parsing one row
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parsed:
    messages: tuple[Mapping[str, str], ...]
    ground_truth: str
    data_source: str


def _present(row: Mapping[str, Any], key: str) -> bool:
    # A null counts as absent: parquet files that mix formats have null columns.
    return row.get(key) is not None


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise _RowProblem(f"field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _RowProblem(f"field {name!r} is empty")
    return value


def _ground_truth(value: object, name: str) -> str:
    # Integers are accepted (AIME answers are often stored as numbers); floats are not, because
    # their text form is ambiguous ("1e-05", "2.0") and DAPO's scorer compares strings exactly.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise _RowProblem(
            f"ground truth {name!r} must be a string or an integer, got "
            f"{type(value).__name__}; store the exact answer text as a string"
        )
    if not value.strip():
        raise _RowProblem(f"ground truth {name!r} is empty")
    return value.strip()


def _data_source(row: Mapping[str, Any], default: str) -> str:
    if not _present(row, "data_source"):
        return default
    return _text(row["data_source"], "data_source").strip()


def _user_message(content: str) -> tuple[Mapping[str, str], ...]:
    return ({"role": "user", "content": content},)


def _chat_messages(value: object) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _RowProblem(
            "field 'prompt' must be a non-empty list of chat messages like "
            '[{"role": "user", "content": "..."}]'
        )
    messages = []
    for position, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise _RowProblem(f"prompt[{position}] must be an object with 'role' and 'content'")
        role = _text(message.get("role"), f"prompt[{position}].role")
        content = message.get("content")
        if not isinstance(content, str):
            raise _RowProblem(f"prompt[{position}].content must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    if not _last_user_text(messages).strip():
        raise _RowProblem("'prompt' needs a user message, and the last one must have text")
    return tuple(messages)


def _last_user_text(messages: Iterable[Mapping[str, str]]) -> str:
    """The last user turn's text ('' without one): the question the policy answers."""
    return next((m["content"] for m in reversed(list(messages)) if m["role"] == "user"), "")


def _parse_verl(row: Mapping[str, Any]) -> _Parsed:
    messages = _chat_messages(row.get("prompt"))
    reward = row.get("reward_model")
    if not isinstance(reward, Mapping) or not _present(reward, "ground_truth"):
        raise _RowProblem(
            "has no reward_model.ground_truth; verl rows carry the answer as "
            '"reward_model": {"ground_truth": "42"}'
        )
    ground_truth = _ground_truth(reward["ground_truth"], "reward_model.ground_truth")
    return _Parsed(messages, ground_truth, _data_source(row, DEFAULT_DATA_SOURCE))


def _gsm8k_final_answer(solution: str) -> str:
    if _GSM8K_MARKER not in solution:
        raise _RowProblem(f"field 'answer' has no '{_GSM8K_MARKER} <final answer>' line (GSM8K format)")
    final = solution.rsplit(_GSM8K_MARKER, 1)[1].strip()
    if not final:
        raise _RowProblem(f"field 'answer' has nothing after '{_GSM8K_MARKER}'")
    # GSM8K writes large numbers as "1,450,000"; DAPO's scorer expects the bare number.
    return final.replace(",", "") if _NUMBER_WITH_SEPARATORS.fullmatch(final) else final


def _parse_gsm8k(row: Mapping[str, Any]) -> _Parsed:
    question = _text(row.get("question"), "question")
    answer = _gsm8k_final_answer(_text(row.get("answer"), "answer"))
    return _Parsed(_user_message(dapo_prompt(question.strip())), answer, _data_source(row, GSM8K_DATA_SOURCE))


def _flat_prompt(row: Mapping[str, Any]) -> str:
    if _present(row, "prompt"):
        return _text(row["prompt"], "prompt")
    for key in ("problem", "question"):
        if _present(row, key):
            return dapo_prompt(_text(row[key], key).strip())
    raise _RowProblem("has no prompt text; give a 'prompt' (full text) or a 'problem'/'question' field")


def _parse_flat(row: Mapping[str, Any]) -> _Parsed:
    prompt = _flat_prompt(row)
    for key in ("ground_truth", "answer"):
        if _present(row, key):
            answer = _ground_truth(row[key], key)
            break
    else:
        raise _RowProblem("has no answer; give a 'ground_truth' or 'answer' field")
    return _Parsed(_user_message(prompt), answer, _data_source(row, DEFAULT_DATA_SOURCE))


_PARSERS: dict[str, Callable[[Mapping[str, Any]], _Parsed]] = {
    "verl": _parse_verl,
    "gsm8k": _parse_gsm8k,
    "flat": _parse_flat,
}


def detect_format(row: Mapping[str, Any]) -> str:
    """The format of a file whose first usable row is ``row`` (rules in the module docs).

    Raises:
        DatasetError: if no rule matches.
    """
    if isinstance(row.get("prompt"), list) or _present(row, "reward_model"):
        return "verl"
    answer = row.get("answer")
    if (
        _present(row, "question")
        and isinstance(answer, str)
        and _GSM8K_MARKER in answer
        and not _present(row, "prompt")
        and not _present(row, "ground_truth")
    ):
        return "gsm8k"
    if any(_present(row, key) for key in ("prompt", "problem", "question")):
        return "flat"
    keys = ", ".join(sorted(map(str, row))[:10]) or "none"
    raise DatasetError(
        f"cannot tell the data format from the fields ({keys}); expected a chat 'prompt' "
        "list (verl), 'question' + 'answer' with '####' (gsm8k), or 'prompt'/'problem'/"
        "'question' + 'answer'/'ground_truth' (flat). Fix: rename the fields or pass format=."
    )


def _read_file(
    path: Path, fmt: str, *, skip_malformed: bool, stats: DatasetStats
) -> Iterator[tuple[str, _Parsed]]:
    """The usable rows of one file as ``(origin, parsed)``; malformed rows raise or are counted."""
    _check_file(path)
    reader, unit = _READERS[path.suffix]
    chosen = None if fmt == "auto" else fmt
    for number, payload in reader(path):
        stats.rows_read += 1
        origin = f"{path}, {unit} {number}"
        try:
            row = _as_object(payload)
            chosen = chosen or detect_format(row)
            parsed = _PARSERS[chosen](row)
        except (_RowProblem, DatasetError) as problem:
            error = DatasetError(f"{origin}: {problem}", path=path, row=number)
            if not skip_malformed:
                raise error from None
            stats.record_malformed(error)
            continue
        yield origin, parsed


# ----------------------------------------------------------------------------------------------------
# Loading several files with de-duplication
# ----------------------------------------------------------------------------------------------------


def _prompt_key(messages: Iterable[Mapping[str, str]]) -> str:
    normalised = [[m["role"], " ".join(unicodedata.normalize("NFC", m["content"]).split())] for m in messages]
    return hashlib.sha1(json.dumps(normalised, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def _as_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, str | Path):
        return [Path(paths)]
    if not paths:
        raise DatasetError("no data files given; list at least one .jsonl or .parquet file")
    return [Path(p) for p in paths]


def load_examples(
    paths: str | Path | Sequence[str | Path],
    *,
    format: str = "auto",
    data_source: str | None = None,
    dedup: bool = True,
    skip_malformed: bool = False,
) -> tuple[list[PromptExample], DatasetStats]:
    """Read prompts from one or more files, in order, de-duplicated across all of them.

    Args:
        format: ``auto`` or one of the formats in the module docs, applied to every file.
        data_source: replaces every row's data source when given.
        dedup: keep only the first occurrence of each prompt.
        skip_malformed: count and skip unreadable rows instead of raising.

    Raises:
        DatasetError: for a missing or unreadable file, or a malformed row unless skipped.
    """
    if format not in FORMATS:
        raise DatasetError(f"unknown format {format!r}; expected one of {FORMATS}")
    files = _as_paths(paths)
    stats = DatasetStats(files=[str(p) for p in files])
    kept_answer: dict[str, str] = {}  # prompt key -> ground truth of its first occurrence
    repeats: dict[str, int] = {}
    examples = []
    for path in files:
        for origin, parsed in _read_file(path, format, skip_malformed=skip_malformed, stats=stats):
            key = _prompt_key(parsed.messages)
            uid = key
            if key in kept_answer:
                if dedup:
                    stats.duplicates_removed += 1
                    stats.conflicting_duplicates += kept_answer[key] != parsed.ground_truth
                    continue
                repeats[key] = repeats.get(key, 1) + 1
                uid = f"{key}-{repeats[key]}"
            else:
                kept_answer[key] = parsed.ground_truth
            examples.append(
                PromptExample(
                    uid=uid,
                    prompt=_last_user_text(parsed.messages),
                    ground_truth=parsed.ground_truth,
                    data_source=data_source or parsed.data_source,
                    messages=parsed.messages,
                    origin=origin,
                )
            )
    stats.final_size = len(examples)
    return examples, stats


def to_verl_row(example: PromptExample, index: int) -> dict[str, Any]:
    """``example`` as a verl-format row (what tools/prepare_data.py writes and the loader reads back)."""
    return {
        "data_source": example.data_source,
        "prompt": [dict(m) for m in example.messages],
        "ability": "MATH",
        "reward_model": {"ground_truth": example.ground_truth, "style": "rule"},
        "extra_info": {"index": index, "uid": example.uid},
    }


# ----------------------------------------------------------------------------------------------------
# Tokens
# ----------------------------------------------------------------------------------------------------


class PromptTokenizer(Protocol):
    """What the loader needs from a tokenizer; every Hugging Face tokenizer qualifies.

    A chat template is used when the object also has a truthy ``chat_template`` and an
    ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False) -> str``.
    """

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def _uses_template(tokenizer: PromptTokenizer, use_chat_template: bool) -> bool:
    return use_chat_template and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    messages: Sequence[Mapping[str, str]], tokenizer: PromptTokenizer, *, use_chat_template: bool = True
) -> str:
    """The prompt text the policy sees: the chat template's rendering, ending with the assistant
    header, or without a template the message contents joined by blank lines (one message: exactly
    its content, which is what the demo's character tokenizer needs)."""
    if _uses_template(tokenizer, use_chat_template):
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages],  # type: ignore[attr-defined]
            add_generation_prompt=True,
            tokenize=False,
        )
    return "\n\n".join(m["content"] for m in messages)


def encode_prompt(
    messages: Sequence[Mapping[str, str]], tokenizer: PromptTokenizer, *, use_chat_template: bool = True
) -> list[int]:
    """Token ids of :func:`render_prompt`'s text."""
    text = render_prompt(messages, tokenizer, use_chat_template=use_chat_template)
    # A chat template writes its own special tokens (BOS, role markers), so the tokenizer must not
    # add them a second time; plain text gets the tokenizer's usual ones, as in pretraining.
    return list(tokenizer.encode(text, add_special_tokens=not _uses_template(tokenizer, use_chat_template)))


def tokenize_examples(
    examples: Iterable[PromptExample],
    tokenizer: PromptTokenizer,
    *,
    max_prompt_length: int,
    overlong_prompt: str = "truncate_left",
    use_chat_template: bool = True,
    stats: DatasetStats | None = None,
) -> list[PromptExample]:
    """``examples`` with ``prompt_ids`` set and the length limit applied (``stats`` is updated).

    Left truncation keeps the end of the prompt, where the question and the generation header are,
    and drops the start of the chat template; that is what verl does for DAPO.

    Raises:
        DatasetError: with ``overlong_prompt="error"``, at the first prompt over the limit.
    """
    if overlong_prompt not in OVERLONG_MODES:
        raise DatasetError(f"unknown overlong_prompt {overlong_prompt!r}; expected one of {OVERLONG_MODES}")
    if max_prompt_length < 1:
        raise DatasetError(f"max_prompt_length must be >= 1; got {max_prompt_length}")
    stats = stats if stats is not None else DatasetStats()
    kept = []
    for example in examples:
        ids = encode_prompt(example.messages, tokenizer, use_chat_template=use_chat_template)
        stats.longest_prompt_tokens = max(stats.longest_prompt_tokens, len(ids))
        if len(ids) > max_prompt_length:
            if overlong_prompt == "error":
                raise DatasetError(
                    f"{example.origin}: prompt is {len(ids)} tokens, over max_prompt_length="
                    f"{max_prompt_length}. Fix: raise rollout.max_prompt_length, or set "
                    "data.overlong_prompt to truncate_left or drop."
                )
            if overlong_prompt == "drop":
                stats.too_long_dropped += 1
                continue
            stats.too_long_truncated += 1
            ids = ids[-max_prompt_length:]
        kept.append(replace(example, prompt_ids=tuple(ids)))
    stats.final_size = len(kept)
    return kept


# ----------------------------------------------------------------------------------------------------
# The data set the trainer iterates
# ----------------------------------------------------------------------------------------------------


class PromptDataset(Sequence[PromptExample]):
    """Prompts in file order (indexing, ``take``) plus a resumable, per-epoch shuffled batch stream.

    Position = ``(epoch, index)``: ``index`` prompts of epoch ``epoch``'s order were handed out.
    ``next_batch`` drops an epoch's tail that is shorter than the batch and starts the next epoch,
    like a drop-last data loader; reshuffling makes a different tail wait each epoch.
    """

    def __init__(
        self,
        examples: Sequence[PromptExample],
        *,
        shuffle: bool = True,
        seed: int = 0,
        stats: DatasetStats | None = None,
    ) -> None:
        if not examples:
            detail = f" ({stats.summary()})" if stats else ""
            raise DatasetError(
                f"the data set is empty after loading{detail}. Fix: check the files, the "
                "length limit and data.overlong_prompt."
            )
        self._examples = tuple(examples)
        self.shuffle = shuffle
        self.seed = seed
        self.stats = stats or DatasetStats(final_size=len(self._examples))
        self._epoch, self._index, self._order = 0, 0, self.epoch_order(0)

    def __len__(self) -> int:
        return len(self._examples)

    @overload
    def __getitem__(self, index: int) -> PromptExample: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[PromptExample]: ...
    def __getitem__(self, index: int | slice) -> PromptExample | Sequence[PromptExample]:
        return self._examples[index]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def index(self) -> int:
        return self._index

    @property
    def remaining_in_epoch(self) -> int:
        """Prompts of the current epoch not handed out yet."""
        return len(self) - self._index

    def take(self, n: int) -> list[PromptExample]:
        """The first ``n`` prompts in file order (all of them if there are fewer), for evaluation."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0; got {n}")
        return list(self._examples[:n])

    def batches_per_epoch(self, batch_size: int) -> int:
        return len(self) // batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices of ``epoch``'s order. Sorting by a keyed hash makes the order a pure function of
        ``(seed, epoch, size)`` that no library upgrade can change, unlike a seeded RNG stream: a
        run resumed in a newer environment still sees the prompts it would have seen."""
        if not self.shuffle:
            return list(range(len(self)))
        salt = f"{self.seed}:{epoch}:".encode()

        def rank(i: int) -> bytes:
            return hashlib.blake2b(salt + str(i).encode(), digest_size=8).digest()

        return sorted(range(len(self)), key=rank)

    def next_batch(self, batch_size: int) -> list[PromptExample]:
        """The next ``batch_size`` prompts, moving to a fresh epoch when this one has too few left."""
        if not 1 <= batch_size <= len(self):
            raise ValueError(f"batch_size must be in [1, {len(self)}] (the data set size); got {batch_size}")
        if self.remaining_in_epoch < batch_size:
            self._start_epoch(self._epoch + 1, index=0)
        chosen = self._order[self._index : self._index + batch_size]
        self._index += batch_size
        return [self._examples[i] for i in chosen]

    def _start_epoch(self, epoch: int, *, index: int) -> None:
        if epoch != self._epoch:
            self._order = self.epoch_order(epoch)
        self._epoch, self._index = epoch, index

    def fingerprint(self) -> str:
        """Hash of the prompt uids in file order: equal exactly when a resumed run has the same data."""
        digest = hashlib.sha1("\n".join(e.uid for e in self._examples).encode("utf-8"))
        return digest.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """The position (plus what must match to resume it), as plain JSON-able values."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "size": len(self),
            "fingerprint": self.fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            DatasetError: if the saved position belongs to other data, another seed or shuffle
                setting (its position would then point at different prompts).
        """
        missing = {"epoch", "index", "seed", "shuffle", "size", "fingerprint"} - set(state)
        if missing:
            raise DatasetError(f"data set state is missing {sorted(missing)}; was it saved by PromptDataset?")
        current = self.state_dict()
        for key in ("size", "fingerprint", "seed", "shuffle"):
            if state[key] != current[key]:
                raise DatasetError(
                    f"cannot resume the data set: the checkpoint has {key}={state[key]!r} but "
                    f"this run has {current[key]!r}. Fix: resume with the same data files, "
                    "length limit, de-duplication and data.seed/shuffle, or start a new run."
                )
        epoch, index = state["epoch"], state["index"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(index, int) and 0 <= index <= len(self)):
            raise DatasetError(f"invalid data set position epoch={epoch!r}, index={index!r}")
        self._start_epoch(epoch, index=index)


def build_dataset(
    paths: str | Path | Sequence[str | Path],
    tokenizer: PromptTokenizer,
    *,
    max_prompt_length: int,
    format: str = "auto",
    data_source: str | None = None,
    dedup: bool = True,
    skip_malformed: bool = False,
    overlong_prompt: str = "truncate_left",
    use_chat_template: bool = True,
    shuffle: bool = True,
    seed: int = 0,
) -> PromptDataset:
    """Load, de-duplicate and tokenize ``paths`` into a :class:`PromptDataset` (its ``stats`` say
    what was removed). Arguments as in :func:`load_examples` and :func:`tokenize_examples`."""
    examples, stats = load_examples(
        paths, format=format, data_source=data_source, dedup=dedup, skip_malformed=skip_malformed
    )
    tokenized = tokenize_examples(
        examples,
        tokenizer,
        max_prompt_length=max_prompt_length,
        overlong_prompt=overlong_prompt,
        use_chat_template=use_chat_template,
        stats=stats,
    )
    return PromptDataset(tokenized, shuffle=shuffle, seed=seed, stats=stats)


def dataset_from_config(
    config: DataConfig, split: str, tokenizer: PromptTokenizer, *, max_prompt_length: int
) -> PromptDataset:
    """The ``train`` or ``eval`` data set of ``config``; evaluation keeps file order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval'; got {split!r}")
    train = split == "train"
    return build_dataset(
        config.train_files if train else config.eval_files,
        tokenizer,
        max_prompt_length=max_prompt_length,
        format=config.format,
        data_source=config.data_source,
        dedup=config.dedup_train if train else config.dedup_eval,
        skip_malformed=config.skip_malformed,
        overlong_prompt=config.overlong_prompt,
        use_chat_template=config.use_chat_template,
        shuffle=train and config.shuffle,
        seed=config.seed,
    )
