"""The data set formats: parsing one row of each published layout into chat messages, a ground truth and a
data source, detecting a file's format, DAPO's prompt around a bare problem, and writing a verl row back.

``format="auto"`` picks one per file from the first row that matches a rule below, in this order; pass
``format=`` to force one.

    ``verl``   ``prompt`` is a list of chat messages ``[{"role": "user", "content": ...}]`` and the
               answer is ``reward_model.ground_truth`` (DAPO-Math-17k, DAPO's AIME parquet).
    ``gsm8k``  ``question`` plus an ``answer`` solution that contains ``#### N``; the ground truth is
               ``N`` without thousands separators, and the question is wrapped in DAPO's prompt.
    ``flat``   one text field and one answer field. ``prompt`` is used verbatim (it is already the
               full prompt); ``problem`` or ``question`` is a bare problem and is wrapped in DAPO's
               prompt. The answer is ``ground_truth`` or ``answer`` (a string or an integer).

A ``data_source`` field, when present, is kept (it selects the reward function); rows without one get
``gsm8k`` for the gsm8k format and ``math_dapo`` otherwise (the prompt asks for DAPO's ``Answer:`` line,
which DAPO's scorer grades). The loader's ``data_source=`` overrides every row.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dapo_megatron.data.errors import DatasetError, RowProblem
from dapo_megatron.records import PromptExample

__all__ = [
    "DAPO_INSTRUCTION",
    "DAPO_REMINDER",
    "PARSERS",
    "Parsed",
    "dapo_prompt",
    "detect_format",
    "last_user_text",
    "to_verl_row",
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


def dapo_prompt(problem: str) -> str:
    """DAPO's training and AIME prompt around a bare problem statement."""
    return f"{DAPO_INSTRUCTION}\n\n{problem}\n\n{DAPO_REMINDER}"


@dataclass(frozen=True)
class Parsed:
    messages: tuple[Mapping[str, str], ...]
    ground_truth: str
    data_source: str


def _present(row: Mapping[str, Any], key: str) -> bool:
    # A null counts as absent: parquet files that mix formats have null columns.
    return row.get(key) is not None


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise RowProblem(f"field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowProblem(f"field {name!r} is empty")
    return value


def _ground_truth(value: object, name: str) -> str:
    # Integers are accepted (AIME answers are often stored as numbers); floats are not, because
    # their text form is ambiguous ("1e-05", "2.0") and DAPO's scorer compares strings exactly.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise RowProblem(
            f"ground truth {name!r} must be a string or an integer, got "
            f"{type(value).__name__}; store the exact answer text as a string"
        )
    if not value.strip():
        raise RowProblem(f"ground truth {name!r} is empty")
    return value.strip()


def _data_source(row: Mapping[str, Any], default: str) -> str:
    if not _present(row, "data_source"):
        return default
    return _text(row["data_source"], "data_source").strip()


def _user_message(content: str) -> tuple[Mapping[str, str], ...]:
    return ({"role": "user", "content": content},)


def _chat_messages(value: object) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise RowProblem(
            "field 'prompt' must be a non-empty list of chat messages like "
            '[{"role": "user", "content": "..."}]'
        )
    messages = []
    for position, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise RowProblem(f"prompt[{position}] must be an object with 'role' and 'content'")
        role = _text(message.get("role"), f"prompt[{position}].role")
        content = message.get("content")
        if not isinstance(content, str):
            raise RowProblem(f"prompt[{position}].content must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    if not last_user_text(messages).strip():
        raise RowProblem("'prompt' needs a user message, and the last one must have text")
    return tuple(messages)


def last_user_text(messages: Iterable[Mapping[str, str]]) -> str:
    """The last user turn's text ('' without one): the question the policy answers."""
    return next((m["content"] for m in reversed(list(messages)) if m["role"] == "user"), "")


def _parse_verl(row: Mapping[str, Any]) -> Parsed:
    messages = _chat_messages(row.get("prompt"))
    reward = row.get("reward_model")
    if not isinstance(reward, Mapping) or not _present(reward, "ground_truth"):
        raise RowProblem(
            "has no reward_model.ground_truth; verl rows carry the answer as "
            '"reward_model": {"ground_truth": "42"}'
        )
    ground_truth = _ground_truth(reward["ground_truth"], "reward_model.ground_truth")
    return Parsed(messages, ground_truth, _data_source(row, DEFAULT_DATA_SOURCE))


def _gsm8k_final_answer(solution: str) -> str:
    if _GSM8K_MARKER not in solution:
        raise RowProblem(f"field 'answer' has no '{_GSM8K_MARKER} <final answer>' line (GSM8K format)")
    final = solution.rsplit(_GSM8K_MARKER, 1)[1].strip()
    if not final:
        raise RowProblem(f"field 'answer' has nothing after '{_GSM8K_MARKER}'")
    # GSM8K writes large numbers as "1,450,000"; DAPO's scorer expects the bare number.
    return final.replace(",", "") if _NUMBER_WITH_SEPARATORS.fullmatch(final) else final


def _parse_gsm8k(row: Mapping[str, Any]) -> Parsed:
    question = _text(row.get("question"), "question")
    answer = _gsm8k_final_answer(_text(row.get("answer"), "answer"))
    return Parsed(_user_message(dapo_prompt(question.strip())), answer, _data_source(row, GSM8K_DATA_SOURCE))


def _flat_prompt(row: Mapping[str, Any]) -> str:
    if _present(row, "prompt"):
        return _text(row["prompt"], "prompt")
    for key in ("problem", "question"):
        if _present(row, key):
            return dapo_prompt(_text(row[key], key).strip())
    raise RowProblem("has no prompt text; give a 'prompt' (full text) or a 'problem'/'question' field")


def _parse_flat(row: Mapping[str, Any]) -> Parsed:
    prompt = _flat_prompt(row)
    for key in ("ground_truth", "answer"):
        if _present(row, key):
            answer = _ground_truth(row[key], key)
            break
    else:
        raise RowProblem("has no answer; give a 'ground_truth' or 'answer' field")
    return Parsed(_user_message(prompt), answer, _data_source(row, DEFAULT_DATA_SOURCE))


PARSERS: dict[str, Callable[[Mapping[str, Any]], Parsed]] = {
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


def to_verl_row(example: PromptExample, index: int) -> dict[str, Any]:
    """``example`` as a verl-format row (what tools/prepare_data.py writes and the loader reads back)."""
    return {
        "data_source": example.data_source,
        "prompt": [dict(m) for m in example.messages],
        "ability": "MATH",
        "reward_model": {"ground_truth": example.ground_truth, "style": "rule"},
        "extra_info": {"index": index, "uid": example.uid},
    }
