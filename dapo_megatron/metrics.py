"""Metrics: TensorBoard scalars and one concise console line per step, from the logging rank only."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any


class MetricsLogger:
    """Writes `name -> value` scalars to TensorBoard under `log_dir` (or $TENSORBOARD_DIR) and one JSON
    line per call to `log_dir/metrics.jsonl` (for scripts and tests), on the logging rank; on other ranks
    every call is a no-op, so callers need no rank checks."""

    def __init__(self, log_dir: Path | str, *, enabled: bool) -> None:
        self.enabled = enabled
        self.log_dir = Path(os.environ.get("TENSORBOARD_DIR", log_dir))
        self._writer = None
        self._jsonl: IO[str] | None = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), max_queue=1000)
            self._jsonl = (self.log_dir / "metrics.jsonl").open("a")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._writer is None or self._jsonl is None:
            return
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), step)
        self._writer.flush()
        self._jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self._jsonl.flush()

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
