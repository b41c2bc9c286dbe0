"""Miniatures of the real data files: a few made-up problems written with the column layouts of DAPO's AIME
2024 parquet, the flat AIME jsonl and Qwen2.5-Math's AIME copy, DAPO-Math-17k, and GSM8K (question, `#### N`
solution), so that what the loader and tools/prepare_data.py do with each layout is tested without the real
samples."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_megatron.data.formats import dapo_prompt

Problem = tuple[str, str]
"""A bare problem statement and its answer."""

PROBLEMS: tuple[Problem, ...] = (
    ("A train travels $60$ miles in $1.5$ hours. Find its speed in miles per hour.", "40"),
    ("Find the number of positive divisors of $36$.", "9"),
    ("Let $x$ satisfy $3x + 7 = 28$. Find $x$.", "7"),
)


def write_jsonl(path: Path, rows: Sequence[object]) -> Path:
    """One row per line; a string row is written as is (for malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: Sequence[dict[str, object]]) -> Path:
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def dapo_rows(
    problems: Sequence[Problem] = PROBLEMS, copies: int = 1, seed: int | None = None
) -> list[dict[str, object]]:
    """verl rows as DAPO publishes them (AIME 2024 parquet, DAPO-Math-17k): the problem in DAPO's prompt as a
    one-message chat, `reward_model.ground_truth`, the problem's index in `extra_info`, a pandas index column.
    Each problem `copies` times, one pass after another, or shuffled by `seed` as DAPO's AIME file is."""
    order = [index for _ in range(copies) for index in range(len(problems))]
    if seed is not None:
        random.Random(seed).shuffle(order)
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": dapo_prompt(problems[index][0]), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": problems[index][1], "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index, "raw_problem": problems[index][0], "split": None},
            "__index_level_0__": position,
        }
        for position, index in enumerate(order)
    ]


def flat_aime_rows(problems: Sequence[Problem] = PROBLEMS) -> list[dict[str, object]]:
    """The flat AIME jsonl: `answer`, the bare `problem` and the full DAPO `prompt` text; ids and links."""
    return [
        {
            "dapo_index": index,
            "aime_id": f"2024-I-{index + 1}",
            "answer": answer,
            "problem": problem,
            "prompt": dapo_prompt(problem),
            "data_source": "math_dapo",
            "reward_style": "rule-lighteval/MATH_v2",
            "source_url": f"https://example.org/aime/{index + 1}",
        }
        for index, (problem, answer) in enumerate(problems)
    ]


def qwen_aime_rows(problems: Sequence[Problem] = PROBLEMS) -> list[dict[str, object]]:
    """Qwen2.5-Math's AIME copy: bare `problem` (and `question`), a worked `solution`, and the answer written
    AIME-style with three digits ("007")."""
    return [
        {
            "id": 60 + index,
            "problem": problem,
            "solution": f"Working it out gives $\\boxed{{{answer}}}$.",
            "answer": f"{int(answer):03d}",
            "url": f"https://example.org/aime/{index + 1}",
            "question": problem,
        }
        for index, (problem, answer) in enumerate(problems)
    ]


def gsm8k_rows(problems: Sequence[Problem] = PROBLEMS) -> list[dict[str, object]]:
    """GSM8K's layout: `question`, and an `answer` solution with calculator annotations ending in `#### N`."""
    return [
        {"question": problem, "answer": f"We compute <<{answer}={answer}>>{answer}.\n#### {answer}"}
        for problem, answer in problems
    ]
