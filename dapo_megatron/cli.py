"""Command-line conventions of the entry points: `--help`, and config errors as one message with exit code 2.

A config mistake (a bad Hydra override, a field out of range, a missing path) is the user's to fix, so it is
reported as `error: ...` on stderr without a traceback, and the process exits 2 like argparse does.
"""

from __future__ import annotations

import functools
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dapo_megatron.config import CONFIG_DIR, ConfigError, compose

__all__ = [
    "COMMON_FIELDS",
    "CONFIG_ERRORS",
    "report_config_error",
    "reports_config_errors",
    "resolved_config",
    "split_cfg_flag",
    "usage",
    "wants_help",
]

P = ParamSpec("P")

OVERRIDES = """\
usage: python -m dapo_megatron.train [KEY=VALUE ...] [--cfg job]     (also dapo-train, torchrun, srun)

Arguments are Hydra overrides of configs/config.yaml, for example:
  experiment=demo                         a recipe from configs/experiment/
  model=qwen2.5-7b parallel=tp2           a config group choice
  trainer.total_steps=100 output_dir=out  a field
  'data.train_files=[a.jsonl,b.jsonl]'    a list (quote it for the shell)
  +key=value / ~key                       add / delete a key (unknown keys are refused)
  dry_run=true                            check the config and plan memory for the planned cluster; start nothing
  --cfg job                               print the resolved config and exit
"""  # noqa: E501 (a usage table; the text is printed as is)

COMMON_FIELDS = {
    "model.hf_dir": "Hugging Face checkpoint the policy starts from",
    "data.train_files": "training prompts (jsonl or parquet, verl's columns or DAPO-Math's)",
    "data.eval_files": "held-out prompts scored every eval.every steps",
    "trainer.total_steps": "rollout steps to train",
    "trainer.train_batch_size": "prompt groups per rollout step (verl: data.train_batch_size)",
    "trainer.ppo_mini_batch_size": "prompt groups per optimizer step",
    "trainer.micro_batch_size": "sequences per forward/backward pass on one data-parallel rank",
    "trainer.gen_batch_size": "prompts sent to the engine per generation round",
    "trainer.save_every": "checkpoint every N steps (0: only at the end)",
    "rollout.n_samples_per_prompt": "responses per prompt (the group size)",
    "rollout.max_response_length": "tokens a response may have",
    "rollout.temperature": "sampling temperature",
    "optim.lr": "learning rate",
    "algo.clip_ratio_high": "upper clip of the ratio (clip-higher)",
    "algo.overlong_buffer_length": "tokens before the cap where the soft length penalty starts",
    "reward.function": "your own scorer, module:function (or reward.function_file + reward.function_name)",
    "reward.endpoint": "a reward service's URL, each sample POSTed to it as JSON (instead of a scorer)",
    "parallel.tensor_model_parallel_size": "tensor-parallel size of the policy",
    "output_dir": "checkpoints, logs and metrics.jsonl",
}
"""The fields `--help` shows with their root defaults: what a new user changes first."""


def usage(config_dir: Path | None = None) -> str:
    """The override syntax, the config groups with their options and the common fields with their
    defaults, read from the config tree itself so the text cannot fall behind it."""
    config_dir = CONFIG_DIR if config_dir is None else config_dir
    chosen = {}
    for entry in OmegaConf.load(config_dir / "config.yaml").get("defaults", []):
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            chosen.update({str(k): str(v) for k, v in dict(entry).items()})
    lines = [OVERRIDES, "Config groups (GROUP=OPTION; * marks the root default):"]
    for group in sorted(path for path in config_dir.iterdir() if path.is_dir()):
        options = sorted(str(p.relative_to(group).with_suffix("")) for p in group.rglob("*.yaml"))
        marked = [f"{o}*" if chosen.get(group.name) == o else o for o in options]
        lines += textwrap.wrap(
            ", ".join(marked), width=110, initial_indent=f"  {group.name:<11} ", subsequent_indent=" " * 14
        )
    root = compose([], config_dir=config_dir)
    lines += ["", "Common fields (KEY=VALUE; root default in brackets):"]
    for key, meaning in COMMON_FIELDS.items():
        default = OmegaConf.to_yaml({"v": OmegaConf.select(root, key, default="unset")})[3:].strip()
        lines.append(f"  {key:<37} {meaning} [{default}]")
    lines += [
        "",
        "Every field is documented on its dataclass (dapo_megatron/*/config.py); `--cfg job` lists them all",
        "with their values. Config errors are one line on stderr and exit with code 2.",
        "",
    ]
    return "\n".join(lines)


def split_cfg_flag(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """(whether `--cfg job` was given, the other arguments). Only `job` is offered: Hydra's own settings
    (`--cfg hydra`) are not used by this trainer."""
    rest, show, args = [], False, list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--cfg", "-c") or arg.startswith("--cfg="):
            value = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if value != "job":
                raise ConfigError(
                    f"--cfg {value or '(nothing)'}: only `--cfg job` (the resolved config) exists"
                )
            show = True
        else:
            rest.append(arg)
    return show, rest


def resolved_config(cfg: DictConfig) -> str:
    """The composed config as YAML with interpolations (output_dir: outputs/${experiment_name}) filled."""
    return OmegaConf.to_yaml(cfg, resolve=True)


CONFIG_ERRORS: tuple[type[BaseException], ...] = (ConfigError, HydraException, OmegaConfBaseException)
"""Exceptions that mean the config is wrong, not the program."""


def wants_help(argv: Sequence[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in argv)


def report_config_error(error: BaseException) -> int:
    """Print `error` as one `error: ...` line (with the cause Hydra wraps, if any); return exit code 2."""
    message = _one_line(str(error))
    cause = error.__cause__
    if cause is not None and not isinstance(error, ConfigError):
        # Hydra reports "Error merging override x=y" and keeps the reason on the cause.
        message += f": {str(cause).splitlines()[0]}" if str(cause) else ""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def _one_line(message: str) -> str:
    """Hydra's multi-line messages as one line: the lines joined by "; ", the tab-indented items of a list
    (Hydra's available options) by ", ", and its config search path left out (Hydra's, not the user's)."""
    text = message.split("\nConfig search path:")[0].strip()
    parts: list[str] = []
    for line in filter(str.strip, text.splitlines()):
        if parts and line.startswith("\t"):  # an item of the list the previous line opened
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line.strip()
        else:
            parts.append(line.strip())
    return "; ".join(parts)


def reports_config_errors(main: Callable[P, int]) -> Callable[P, int]:
    """A console script's `main` whose config errors end as the trainer's do: `report_config_error`."""

    @functools.wraps(main)
    def reporting(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except CONFIG_ERRORS as error:
            return report_config_error(error)

    return reporting
