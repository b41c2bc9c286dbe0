"""Loading prompt data sets: reading one or more files with :mod:`~dapo_megatron.data.file_readers`,
parsing each row with :mod:`~dapo_megatron.data.formats`, de-duplicating across the files, and (with
:func:`build_dataset` / :func:`dataset_from_config`) tokenizing the result into a
:class:`~dapo_megatron.data.prompt_dataset.PromptDataset`.

Two prompts are the same when their messages (role and content) are equal after Unicode NFC normalisation,
collapsing whitespace runs and stripping; case is kept because it matters in math. The first occurrence is
kept, in file order. The ``uid`` is a hash of that normalised text, so it is stable across runs, file
orderings and machines; with de-duplication off, the k-th repeat of a prompt gets ``<hash>-k`` so that uids
stay unique (rollout groups are keyed by them).
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dapo_megatron.data.config import FORMATS
from dapo_megatron.data.errors import DatasetError, RowProblem
from dapo_megatron.data.file_readers import READERS, as_object, check_file
from dapo_megatron.data.formats import PARSERS, Parsed, detect_format, last_user_text
from dapo_megatron.data.prompt_dataset import PromptDataset
from dapo_megatron.data.prompt_tokens import PromptTokenizer, tokenize_examples
from dapo_megatron.data.stats import DatasetStats
from dapo_megatron.records import PromptExample

if TYPE_CHECKING:
    from dapo_megatron.data.config import DataConfig

__all__ = ["build_dataset", "dataset_from_config", "load_examples"]


def _read_file(
    path: Path, fmt: str, *, skip_malformed: bool, stats: DatasetStats
) -> Iterator[tuple[str, Parsed]]:
    """The usable rows of one file as ``(origin, parsed)``; malformed rows raise or are counted."""
    check_file(path)
    reader, unit = READERS[path.suffix]
    chosen = None if fmt == "auto" else fmt
    for number, payload in reader(path):
        stats.rows_read += 1
        origin = f"{path}, {unit} {number}"
        try:
            row = as_object(payload)
            chosen = chosen or detect_format(row)
            parsed = PARSERS[chosen](row)
        except (RowProblem, DatasetError) as problem:
            error = DatasetError(f"{origin}: {problem}", path=path, row=number)
            if not skip_malformed:
                raise error from None
            stats.record_malformed(error)
            continue
        yield origin, parsed


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
        format: ``auto`` or one of the formats in :mod:`dapo_megatron.data.formats`, applied to every file.
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
                    prompt=last_user_text(parsed.messages),
                    ground_truth=parsed.ground_truth,
                    data_source=data_source or parsed.data_source,
                    messages=parsed.messages,
                    origin=origin,
                )
            )
    stats.final_size = len(examples)
    return examples, stats


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
