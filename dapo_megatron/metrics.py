"""Metrics and the console, from the logging rank only.

Scalars go to the loggers `trainer.loggers` names: TensorBoard, `metrics.jsonl` (one JSON line per call, for
scripts and tests) and optionally Weights & Biases. Console lines go through the `dapo_megatron` logger
(`console`): INFO on the logging rank, WARNING elsewhere, to stdout unless the application configured
logging itself, so users can quiet or redirect it with the standard `logging` module.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

LOGGERS = ("tensorboard", "jsonl", "wandb")
"""What `trainer.loggers` may name."""

console = logging.getLogger("dapo_megatron")
"""The package's logger: `console.info` for the lines users watch, `warning` for what they should act on."""


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the current `sys.stdout`, so a redirect made after set-up (pytest, a notebook) still sees
    the lines; warnings and errors carry their level."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_LevelPrefix())

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stdout

    @stream.setter
    def stream(self, _: IO[str]) -> None:
        pass


class _LevelPrefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno <= logging.INFO else f"{record.levelname}: {text}"


def configure_console(*, logging_rank: bool, level: str = "INFO") -> None:
    """The `dapo_megatron` logger at `level` on the logging rank and at least WARNING elsewhere (every rank's
    warnings matter, one rank's progress is enough). Its stdout handler is added once, and only when the root
    logger has none: an application that configured logging keeps its own handlers and format."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"trainer.log_level must be DEBUG, INFO, WARNING or ERROR; got {level!r}")
    console.setLevel(numeric if logging_rank else max(numeric, logging.WARNING))
    if not logging.getLogger().handlers and not any(isinstance(h, _ConsoleHandler) for h in console.handlers):
        console.addHandler(_ConsoleHandler())


class MetricsLogger:
    """Writes `name -> value` scalars, on the logging rank, to each of `loggers`: TensorBoard event files in
    `log_dir` (or $TENSORBOARD_DIR), `log_dir/metrics.jsonl`, and a Weights & Biases run (project
    `wandb_project`, named `run_name`, with `config` attached; its files under `log_dir`'s parent). On other
    ranks every call is a no-op, so callers need no rank checks."""

    def __init__(
        self,
        log_dir: Path | str,
        *,
        enabled: bool,
        loggers: Sequence[str] = ("tensorboard", "jsonl"),
        config: Mapping[str, Any] | None = None,
        run_name: str | None = None,
        wandb_project: str = "dapo_megatron",
    ) -> None:
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.loggers: unknown {unknown}; choose from {list(LOGGERS)}")
        self.enabled = enabled
        self.log_dir = Path(os.environ.get("TENSORBOARD_DIR", log_dir))
        self._writer = None
        self._jsonl: IO[str] | None = None
        self._wandb: Any = None
        if not enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), max_queue=1000)
        if "jsonl" in loggers:
            self._jsonl = (self.log_dir / "metrics.jsonl").open("a")
        if "wandb" in loggers:
            self._wandb = _start_wandb(wandb_project, run_name, config, Path(log_dir).parent)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.enabled:
            return
        values = {name: float(value) for name, value in metrics.items()}
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(name, value, step)
            self._writer.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _start_wandb(project: str, name: str | None, config: Mapping[str, Any] | None, directory: Path) -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "trainer.loggers includes wandb but the wandb package is not installed: pip install wandb "
            "(requirements.txt pins it), or drop wandb from trainer.loggers"
        ) from error
    directory.mkdir(parents=True, exist_ok=True)
    # Offline or online is wandb's own choice (WANDB_MODE, `wandb login`), as users of it expect.
    return wandb.init(project=project, name=name, config=dict(config or {}), dir=str(directory))


def format_line(prefix: str, fields: Mapping[str, float | int | str]) -> str:
    """`prefix | key value | key value`, numbers in a compact fixed style."""
    parts = [prefix]
    for key, value in fields.items():
        if isinstance(value, float):
            text = (
                f"{value:.3g}" if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4) else f"{value:.3f}"
            )
            if math.isnan(value):
                text = "nan"
        else:
            text = str(value)
        parts.append(f"{key} {text}")
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: short enough for the step line.

    >>> [format_duration(s) for s in (42.4, 185, 7620)]
    ['42s', '3m05s', '2h07m']
    """
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def spread(prefix: str, values: Any) -> dict[str, float]:
    """`prefix/mean|max|min` of a non-empty 1-D tensor, as verl names a batch statistic."""
    return {
        f"{prefix}/mean": float(values.float().mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }
