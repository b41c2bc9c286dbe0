#!/usr/bin/env python
"""Draw training curves from runs' `metrics.jsonl` into one PNG: one panel per metric, one line per label.

    python tools/plot_metrics.py outputs/demo --output demo.png
    python tools/plot_metrics.py runs/a/seed0=A runs/a/seed1=A runs/b/seed0=B \\
        --metric val-core/math_dapo/acc/mean@1 --metric actor/entropy --output ladder.png

A run is a trainer output directory (its `tensorboard/metrics.jsonl` is read) or a metrics.jsonl file, with
an optional `=LABEL`. Runs that share a label are seeds of one configuration: the line is their mean at each
step and the band spans their minimum to maximum. A metric is drawn at the steps whose records carry it
(evaluation only every `eval.every` steps, for instance); `--x` picks the record field on the horizontal axis.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

EVAL_ACCURACY = "val-core/math_dapo/acc/mean@1"
"""The demo's held-out accuracy under verl's validation name (its problems' data source is math_dapo)."""
ENTROPY = "actor/entropy"
RESPONSE_LENGTH = "response_length/mean"
DEFAULT_METRICS = (EVAL_ACCURACY, ENTROPY, RESPONSE_LENGTH)
"""Held-out accuracy, policy entropy and mean response length: the DAPO paper's Figures 2, 3 and 7."""
STEP = "step"

Records = list[dict[str, Any]]


def metrics_file(run: Path) -> Path:
    """The metrics.jsonl of a run directory (or the file itself)."""
    path = run / "tensorboard" / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(
            f"no metrics at {path}: pass a trainer output_dir (holding tensorboard/metrics.jsonl) or the file"
        )
    return path


def read_metrics(run: Path) -> Records:
    """The run's records in order. A last line cut off mid-write (a run still going) is skipped."""
    path = metrics_file(run)
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON record: {line[:80]!r}") from None
    return records


def series(
    records: Iterable[Mapping[str, Any]], metric: str, x: str = STEP
) -> tuple[list[float], list[float]]:
    """(x, value) of the records that carry both fields, non-finite values dropped; the last record wins
    where several share an x (a resumed run repeats steps)."""
    points: dict[float, float] = {}
    for record in records:
        if x in record and metric in record and math.isfinite(float(record[metric])):
            points[float(record[x])] = float(record[metric])
    xs = sorted(points)
    return xs, [points[k] for k in xs]


def band(
    runs: Sequence[Records], metric: str, x: str = STEP
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean, minimum and maximum over runs at each x that every run reached and logged the metric at (so
    the mean never mixes in fewer seeds where one run stopped early)."""
    per_run = [dict(zip(*series(records, metric, x), strict=True)) for records in runs]
    shared = sorted(set.intersection(*(set(points) for points in per_run))) if per_run else []
    values = [[points[k] for points in per_run] for k in shared]
    return (
        shared,
        [sum(v) / len(v) for v in values],
        [min(v) for v in values],
        [max(v) for v in values],
    )


def plot(
    groups: Mapping[str, Sequence[Records]],
    metrics: Sequence[str],
    output: Path,
    *,
    x: str = STEP,
    title: str | None = None,
) -> Path:
    """One panel per metric, one mean line (with a min-max band over several runs) per label; writes a PNG.
    Raises when no run carries a metric, which is how a renamed metric tag shows up."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the machines this runs on
    import matplotlib.pyplot as plt

    missing = [m for m in metrics if not any(series(r, m, x)[0] for runs in groups.values() for r in runs)]
    if missing:
        present = sorted({key for runs in groups.values() for r in runs for record in r for key in record})
        raise ValueError(f"no run logs {missing} against {x!r}; the records hold: {', '.join(present)}")
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.4 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for label, runs in groups.items():
            xs, mean, low, high = band(runs, metric, x)
            (line,) = ax.plot(xs, mean, label=f"{label} (n={len(runs)})" if len(runs) > 1 else label)
            if len(runs) > 1:
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_xlabel(x)
        ax.set_title(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:  # wrapped to the figure's width (about 60 characters a panel at the default font size)
        fig.suptitle(textwrap.fill(title, width=60 * len(metrics), break_on_hyphens=False))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def parse_run(spec: str) -> tuple[str, Path]:
    """`PATH=LABEL` or `PATH` (labelled by its directory name)."""
    path, _, label = spec.partition("=")
    run = Path(path)
    return label or (run.name if run.is_dir() else run.parent.parent.name), run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="run directory or metrics.jsonl, optionally =LABEL")
    parser.add_argument("--metric", action="append", help=f"repeatable; default: {' '.join(DEFAULT_METRICS)}")
    parser.add_argument("--x", default=STEP, help="record field on the horizontal axis (default: step)")
    parser.add_argument("--title")
    parser.add_argument("--output", type=Path, required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    groups: dict[str, list[Records]] = {}
    try:
        for spec in args.runs:
            label, run = parse_run(spec)
            groups.setdefault(label, []).append(read_metrics(run))
        plot(groups, args.metric or DEFAULT_METRICS, args.output, x=args.x, title=args.title)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
