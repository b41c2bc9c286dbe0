"""Where the driver's prompts come from: data files (`data.train_files`), or a synthetic arithmetic task."""

from __future__ import annotations

from typing import Any

from dapo_megatron.data import arithmetic
from dapo_megatron.data.loading import dataset_from_config
from dapo_megatron.data.prompt_dataset import PromptDataset
from dapo_megatron.data.prompt_tokens import PromptTokenizer
from dapo_megatron.records import Prompt, PromptExample


class DatasetPrompts:
    """An endless, resumable stream of `Prompt`s over a `PromptDataset` (seeded reshuffle every epoch)."""

    def __init__(self, dataset: PromptDataset) -> None:
        self.dataset = dataset

    def __iter__(self) -> DatasetPrompts:
        return self

    def __next__(self) -> Prompt:
        return to_prompt(self.dataset.next_batch(1)[0])

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


def to_prompt(example: PromptExample) -> Prompt:
    assert example.prompt_ids is not None, "tokenize the data set first"
    return Prompt(
        uid=example.uid,
        ids=list(example.prompt_ids),
        ground_truth=example.ground_truth,
        data_source=example.data_source,
    )


def arithmetic_dataset(
    split: str,
    tokenizer: PromptTokenizer,
    *,
    seed: int,
    shuffle: bool,
    task: str = "addition",
    split_seed: int | None = None,
) -> PromptDataset:
    """A synthetic task (`data.task`) as a data set, scored by DAPO's scorer (`Answer: <sum>`); prompts are
    raw text. `split_seed` (default `seed`) picks the split's problems, `seed` the epoch shuffles."""
    examples = [
        PromptExample(
            uid=f"arithmetic-{split}-{i}",
            prompt=p.prompt,
            ground_truth=p.answer,
            data_source="math_dapo",
            messages=({"role": "user", "content": p.prompt},),
            origin=f"{task} {split} #{i}",
            prompt_ids=tuple(tokenizer.encode(p.prompt, add_special_tokens=False)),
        )
        for i, p in enumerate(
            arithmetic.problems(split, seed=seed if split_seed is None else split_seed, task=task)
        )
    ]
    return PromptDataset(examples, shuffle=shuffle, seed=seed)


def build_prompt_sources(job: Any, tokenizer: PromptTokenizer) -> tuple[DatasetPrompts, list[Prompt]]:
    """(training stream, evaluation problems) from `data.train_files` / `data.eval_files`, or the synthetic
    task `data.task` when no files are given."""
    limit = job.rollout.max_prompt_length
    task, split_seed = job.data.task, job.data.split_seed(job.seed)
    if job.data.train_files:
        train = dataset_from_config(job.data, "train", tokenizer, max_prompt_length=limit)
    else:
        train = arithmetic_dataset(
            "rl", tokenizer, seed=job.seed, shuffle=job.data.shuffle, task=task, split_seed=split_seed
        )
    if job.data.eval_files:
        evaluation = dataset_from_config(job.data, "eval", tokenizer, max_prompt_length=limit)
    else:
        evaluation = arithmetic_dataset(
            "eval", tokenizer, seed=job.seed, shuffle=False, task=task, split_seed=split_seed
        )
    return DatasetPrompts(train), [to_prompt(e) for e in evaluation.take(job.eval.num_problems)]
