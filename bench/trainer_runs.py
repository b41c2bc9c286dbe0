"""Helpers the trainer-level benchmarks share (not a benchmark itself: run.py only runs `bench_*.py`).

`train_run` starts `python -m dapo_megatron.train` as a subprocess and follows its
`tensorboard/metrics.jsonl` while it runs, so every record gets the wall-clock time at which it appeared,
measured from the launch: the trainer logs durations but no timestamps, and time-to-accuracy must include
start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_megatron.data.arithmetic import warmed_up_on

REPO = Path(__file__).resolve().parents[1]
DEMO_BASE = REPO / "outputs" / "demo_base"


@dataclass
class Record:
    seconds: float
    """Since the launch, when the line appeared (to within the polling interval)."""
    metrics: dict[str, float]


def ensure_base(
    base: Path, overrides: Sequence[str] = (), *, task: str = "addition", timeout: float = 4 * 3600
) -> Path:
    """Build the base policy for `task` with tools/make_demo_base.py unless `base` already holds one; refuse a
    base warmed up on another task (its summary says which; bases from before tasks existed are
    `addition`). The default `timeout` has room for the ~30M base: one to two hours on two cores."""
    summary = base / "warmup_summary.json"
    if (base / "config.json").exists():
        built = warmed_up_on(json.loads(summary.read_text()))[0] if summary.exists() else task
        if built != task:
            raise ValueError(
                f"{base} was warmed up on data.task={built}, not {task}: remove it or pass another base"
            )
        return base
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "make_demo_base.py"),
            "--output",
            str(base),
            "--force",
            f"data.task={task}",
            *overrides,
        ],
        check=True,
        cwd=REPO,
        timeout=timeout,
        env=bench_env(os.cpu_count() or 1),  # no engine beside the warm-up: every core
    )
    return base


def task_seed(base: Path) -> int:
    """The seed that split the base's task when it was warmed up. RL runs on the base split with it
    (`data.task_seed`), whatever their own seed, so its held-out problems are ones its warm-up never saw."""
    summary = json.loads((base / "warmup_summary.json").read_text())
    return warmed_up_on(summary)[1]


def bench_env(threads: int = 1) -> dict[str, str]:
    # The trainer's threads beside a generating engine (as tools/demo.sh sets it); it takes the engine's cores
    # whenever the engine idles (trainer.cpu_idle_cores).
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def train_run(
    overrides: Sequence[str],
    out_dir: Path,
    *,
    timeout: float,
    threads: int = 1,
    poll_s: float = 0.1,
    experiment: str = "demo",
) -> list[Record]:
    """One trainer job (`experiment=<experiment>` + overrides, output in `out_dir`); its metrics records in
    order. Raises with the end of the job's log when it fails or times out. `out_dir` starts empty: a run an
    earlier call left there would refuse to start over its checkpoints, and its metrics read as this run's."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    log_path, jsonl = out_dir / "train.log", out_dir / "tensorboard" / "metrics.jsonl"
    command = [
        sys.executable,
        "-m",
        "dapo_megatron.train",
        f"experiment={experiment}",
        f"output_dir={out_dir}",
        "trainer.resume=never",
        *overrides,
    ]
    records: list[Record] = []
    offset, pending = 0, ""
    started = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=bench_env(threads)
        )
        try:
            while True:
                done = proc.poll() is not None
                if jsonl.exists():
                    with jsonl.open() as f:
                        f.seek(offset)
                        chunk = f.read()
                        offset = f.tell()
                    now = time.perf_counter() - started
                    pending += chunk
                    *lines, pending = pending.split("\n")
                    records += [Record(now, json.loads(line)) for line in lines if line.strip()]
                if done:
                    break
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"trainer ran past {timeout:.0f}s")
                time.sleep(poll_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"{' '.join(command)} did not finish; end of {log_path}:\n{tail(log_path)}"
            ) from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited with {proc.returncode}; end of {log_path}:\n{tail(log_path)}"
        )
    return records


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median with the 10th-90th percentile range (the machine is shared: one number alone says little)."""
    if not values:
        return {"median": None, "p10": None, "p90": None, "n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"median": statistics.median(ordered), "p10": pick(0.1), "p90": pick(0.9), "n": len(ordered)}


def describe(name: str, stats: dict[str, Any], unit: str = "") -> str:
    if stats["median"] is None:
        return f"{name}: none"
    return (
        f"{name}: median {stats['median']:.3g}{unit} (p10 {stats['p10']:.3g}, p90 {stats['p90']:.3g}, "
        f"n={stats['n']})"
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: float | None) -> str:
    """How ratios are printed for bench/run.py: `None` when there is nothing to compare."""
    return "None" if value is None else f"{value:.3f}"
