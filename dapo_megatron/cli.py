"""Command-line conventions of the entry points: `--help`, and config errors as one message with exit code 2.

A config mistake (a bad Hydra override, a field out of range, a missing path) is the user's to fix, so it is
reported as `error: ...` on stderr without a traceback, and the process exits 2 like argparse does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dapo_megatron.config import ConfigError

__all__ = ["CONFIG_ERRORS", "USAGE", "report_config_error", "wants_help"]

USAGE = """\
usage: python -m dapo_megatron.train [KEY=VALUE ...]     (also under torchrun and srun)

Arguments are Hydra overrides of configs/config.yaml, for example:
  experiment=demo                         a recipe from configs/experiment/
  model=qwen2.5-7b parallel=tp2           a config group choice
  trainer.total_steps=100 output_dir=out  a field
  +key=value / ~key                       add / delete a key (unknown keys are refused)
  dry_run=true                            check the config and plan memory for the planned cluster; start nothing

Fields are documented on their dataclasses (dapo_megatron/*/config.py). Config errors exit with code 2.
"""  # noqa: E501 (a usage table; the text is printed as is)


def _config_errors() -> tuple[type[BaseException], ...]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return ConfigError, HydraException, OmegaConfBaseException


CONFIG_ERRORS = _config_errors()
"""Exceptions that mean the config is wrong, not the program."""


def wants_help(argv: Sequence[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in argv)


def report_config_error(error: BaseException) -> int:
    """Print `error` as one `error: ...` message (with the cause Hydra wraps, if any); return exit code 2."""
    message = str(error).strip()
    cause = error.__cause__
    if cause is not None and not isinstance(error, ConfigError):
        # Hydra reports "Error merging override x=y" and keeps the reason on the cause.
        message += f": {str(cause).splitlines()[0]}" if str(cause) else ""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2
