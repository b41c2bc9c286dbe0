"""Configuration of the prompt data sets (the ``data`` group)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_megatron.data.arithmetic import TASKS

__all__ = ["FORMATS", "OVERLONG_MODES", "DataConfig"]

FORMATS = ("auto", "verl", "gsm8k", "flat")
"""File formats the loader reads; ``auto`` detects one per file (see ``data.formats``)."""

OVERLONG_MODES = ("truncate_left", "drop", "error")
"""What happens to a prompt longer than ``max_prompt_length`` tokens."""


@dataclass
class DataConfig:
    """Where prompts come from and how they are cleaned before rollouts.

    The prompt length limit itself is ``rollout.max_prompt_length`` (one number shared with the
    engine); this group only says what to do with prompts above it.
    """

    train_files: list[str] = field(default_factory=list)
    """``.jsonl`` / ``.parquet`` files of training prompts, read in order and de-duplicated together.
    Empty for the laptop demo, which trains on its synthetic task (``data.arithmetic``)."""

    eval_files: list[str] = field(default_factory=list)
    """Evaluation prompts, e.g. the 30 AIME 2024 problems."""

    task: str = "addition"
    """The synthetic task (``data.arithmetic.TASKS``) trained on when ``train_files`` is empty and held out
    for evaluation when ``eval_files`` is empty; the warm-up (tools/make_demo_base.py) trains on the same
    one, so a base and the RL run on it must be given the same value."""

    task_seed: int | None = None
    """Seed of the task's split into warm-up, RL and held-out problems; None: the job seed. A base keeps
    its held-out problems unseen only for RL runs that split with its seed (tools/make_demo_base.py writes
    it to warmup_summary.json), so a run with another job seed on that base sets this one to the base's."""

    format: str = "auto"
    """File format of every file: ``auto`` (detected per file), ``verl``, ``gsm8k`` or ``flat``."""

    data_source: str | None = None
    """Replace every row's ``data_source`` (which picks the reward function); None keeps the file's."""

    dedup_train: bool = True
    """Drop repeated prompts. The public DAPO-Math-17k parquet holds each prompt ~100 times."""

    dedup_eval: bool = True
    """Drop repeated eval prompts. DAPO's AIME parquet repeats each problem 32 times to get avg@32
    with one sample per row; de-duplicated, the evaluator draws 32 samples per problem instead."""

    overlong_prompt: str = "truncate_left"
    """``truncate_left`` keeps the last ``max_prompt_length`` tokens (DAPO: verl's truncation=left),
    ``drop`` removes the prompt, ``error`` stops the run. Every case is counted in the stats."""

    skip_malformed: bool = False
    """Skip and count rows that cannot be read instead of stopping at the first one."""

    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (DAPO does, also for base models). Without a
    template, or when False, the message contents are joined and tokenized as plain text."""

    shuffle: bool = True
    """Reshuffle the training prompts every epoch (evaluation keeps file order)."""

    seed: int = 0
    """Seed of the epoch shuffles; separate from the job seed so model initialisation experiments do
    not change the data order."""

    def split_seed(self, job_seed: int) -> int:
        """The seed that splits `task`'s problems (see `task_seed`)."""
        return job_seed if self.task_seed is None else self.task_seed

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"data.task must be one of {TASKS}; got {self.task!r}")
        if self.format not in FORMATS:
            raise ValueError(f"data.format must be one of {FORMATS}; got {self.format!r}")
        if self.overlong_prompt not in OVERLONG_MODES:
            raise ValueError(
                f"data.overlong_prompt must be one of {OVERLONG_MODES}; got {self.overlong_prompt!r}"
            )
        if self.data_source is not None and not self.data_source.strip():
            raise ValueError("data.data_source must be a non-empty name or null (keep each row's own)")
