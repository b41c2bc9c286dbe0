#!/usr/bin/env python
"""The DAPO paper's ablation ladder (its Table 1) at laptop size: every rung x several seeds, as trainer runs.

    python bench/ablation.py [--seeds 0 1 2] [--steps 60] [--rungs 0_naive_grpo ...] \\
        [--runs-dir /tmp/ablation_runs] [--out bench/ablation] [--target 0.45] [--report-only]

The rungs are `configs/experiment/ablation/*.yaml`, each the previous one plus one change: naive GRPO,
+ overlong filtering, + clip-higher, + soft overlong punishment, + token-level loss, + dynamic sampling
(DAPO). Each (rung, seed) is one `python -m dapo_megatron.train` job on the `digit_sum` task (responses of
14-31 tokens, so the rungs that act on length and aggregation change the gradient) from the demo's model
warmed up on that task (built first if `--base` holds none); a run whose
`timed_metrics.jsonl` exists is not run again, so an interrupted ladder continues where it stopped and
`--report-only` rebuilds the report from the runs alone.

Writes `<out>/table.md` (per rung, over seeds: final and best held-out accuracy, mean +- standard
deviation; how many seeds reached `--target` held-out accuracy and the median time and generated samples
they took; entropy and mean response length over the last steps; the share of trained samples cut off at the
response cap) and three PNGs drawn by
tools/plot_metrics.py, one line per rung (mean over seeds, band min-max) against the step: held-out
accuracy, entropy and response length (the paper's Figures 2, 3 and 7).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_runs import REPO, ensure_base, task_seed, train_run

sys.path.insert(0, str(REPO))
from tools import plot_metrics  # tools/ is not installed with the package

RUNGS = (
    "0_naive_grpo",
    "1_overlong_filter",
    "2_clip_higher",
    "3_soft_overlong",
    "4_token_level_loss",
    "5_dapo",
)
LABELS = {
    "0_naive_grpo": "naive GRPO",
    "1_overlong_filter": "+ overlong filtering",
    "2_clip_higher": "+ clip-higher",
    "3_soft_overlong": "+ soft overlong punishment",
    "4_token_level_loss": "+ token-level loss",
    "5_dapo": "+ dynamic sampling (DAPO)",
}
TITLE = "DAPO ablation ladder, digit_sum (mean over seeds, band: min-max)"
TASK = "digit_sum"
BASE = REPO / "outputs" / "digit_sum_base"
BASE_WARMUP = ("warmup.target_accuracy=0.15", "warmup.eval_mode=teacher_forced")
"""The base's warm-up stops once 15% of the held-out problems are written exactly (working and answer),
~500 steps and ~1.5 minutes on two cores; its greedy held-out accuracy is then ~0.29 (right answers also
come with slips in the working): the format and short chains are learned, long ones mostly not, which
leaves RL room. Teacher-forced: greedy decoding of ~30-token responses without a KV cache, every few steps,
would take longer than the training."""
TIMED = "timed_metrics.jsonl"
SECONDS = "bench/seconds"
"""Added to each stored record: when it appeared, since the job's launch (start-up included)."""


@dataclass(frozen=True)
class Names:
    """The metric tags the report reads (the trainer's names; parameters so that renamed tags need no code
    change)."""

    accuracy: str = plot_metrics.EVAL_ACCURACY
    entropy: str = plot_metrics.ENTROPY
    response_length: str = plot_metrics.RESPONSE_LENGTH
    samples_per_kept: str = "dynamic_sampling/samples_per_kept"
    kept_groups: str = "dynamic_sampling/kept_groups"
    cut_at_cap: str = "response_length/clip_ratio"


def rung_dir(runs_dir: Path, rung: str, seed: int) -> Path:
    return runs_dir / rung / f"seed{seed}"


def run_one(rung: str, seed: int, args: argparse.Namespace) -> Path:
    out = rung_dir(args.runs_dir, rung, seed)
    if (out / TIMED).exists():
        return out
    overrides = [
        f"model.hf_dir={args.base}",
        f"seed={seed}",
        f"data.task_seed={task_seed(args.base)}",
        *([f"trainer.total_steps={args.steps}"] if args.steps else []),
        *args.overrides,
    ]
    records = train_run(overrides, out, timeout=args.timeout, experiment=f"ablation/{rung}")
    lines = [json.dumps({**r.metrics, SECONDS: r.seconds}) for r in records]
    (out / (TIMED + ".tmp")).write_text("".join(f"{line}\n" for line in lines))
    (out / (TIMED + ".tmp")).rename(out / TIMED)  # only a finished run counts as done
    return out


def samples_per_step(record: dict[str, Any], names: Names, group_size: int) -> float:
    """Samples generated for one step: the kept groups' samples times the generated-per-kept ratio that
    dynamic sampling reports (1 without it)."""
    return record.get(names.samples_per_kept, 1.0) * record[names.kept_groups] * group_size


def summarise_run(
    records: Sequence[dict[str, Any]], names: Names, *, target: float, group_size: int, tail: int
) -> dict[str, Any]:
    """One run's numbers: final and best held-out accuracy, when (seconds since launch, samples generated
    by then) it first reached `target`, entropy and response length averaged over its last `tail` training
    steps, and the share of trained samples cut off at the response cap (over all steps, and the most in one
    step): where it is ~0, the rungs that act on overlong samples change nothing."""
    evals = [r for r in records if names.accuracy in r]
    steps = [r for r in records if names.kept_groups in r]
    if not evals or not steps:
        raise ValueError(
            f"the records carry no {names.accuracy!r} or {names.kept_groups!r}: pass the trainer's metric "
            "names (--accuracy-metric and friends)"
        )
    reached = next((r for r in evals if r[names.accuracy] >= target), None)
    samples = None
    if reached is not None:
        step = reached.get("step", 0)
        samples = sum(samples_per_step(r, names, group_size) for r in steps if r.get("step", 0) <= step)
    last = steps[-tail:]
    return {
        "final": evals[-1][names.accuracy],
        "best": max(r[names.accuracy] for r in evals),
        "seconds_to_target": None if reached is None else reached[SECONDS],
        "samples_to_target": samples,
        "entropy": statistics.fmean(r[names.entropy] for r in last),
        "response_length": statistics.fmean(r[names.response_length] for r in last),
        "cut_at_cap": statistics.fmean(r.get(names.cut_at_cap, 0.0) for r in steps),
        "cut_at_cap_max": max(r.get(names.cut_at_cap, 0.0) for r in steps),
        "seconds": records[-1][SECONDS],
    }


def mean_sd(values: Sequence[float], digits: int = 3) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def table(summaries: dict[str, list[dict[str, Any]]], target: float) -> str:
    """The markdown table, one row per rung, statistics over its seeds."""
    head = (
        "| rung | seeds | final held-out acc | best held-out acc | reached "
        f"{target:g} | time to {target:g} (s, median) | samples to {target:g} (median) | entropy (end) | "
        "response length (end) | cut at the cap (%: all steps, most in a step) | run time (s, mean) |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for rung, runs in summaries.items():
        reached = [r for r in runs if r["seconds_to_target"] is not None]
        to_target = [
            f"{statistics.median(r[key] for r in reached):.0f}" if reached else "-"
            for key in ("seconds_to_target", "samples_to_target")
        ]
        rows.append(
            f"| {LABELS.get(rung, rung)} | {len(runs)} | {mean_sd([r['final'] for r in runs])} | "
            f"{mean_sd([r['best'] for r in runs])} | {len(reached)}/{len(runs)} | {to_target[0]} | "
            f"{to_target[1]} | {mean_sd([r['entropy'] for r in runs])} | "
            f"{mean_sd([r['response_length'] for r in runs], 2)} | "
            f"{100 * statistics.fmean(r['cut_at_cap'] for r in runs):.2f}, "
            f"{100 * max(r['cut_at_cap_max'] for r in runs):.1f} | "
            f"{statistics.fmean(r['seconds'] for r in runs):.0f} |"
        )
    return "\n".join(rows) + "\n"


def load_runs(runs_dir: Path, rungs: Sequence[str], seeds: Sequence[int]) -> dict[str, list[list[dict]]]:
    """The stored records of every finished (rung, seed), by rung; rungs without one are left out."""
    found: dict[str, list[list[dict]]] = {}
    for rung in rungs:
        for seed in seeds:
            path = rung_dir(runs_dir, rung, seed) / TIMED
            if path.exists():
                found.setdefault(rung, []).append(plot_metrics.read_metrics(path))
    return found


def report(
    runs: dict[str, list[list[dict]]],
    out: Path,
    names: Names,
    *,
    target: float,
    group_size: int,
    tail: int = 5,
) -> str:
    """Write table.md and the three plots under `out`; returns the table."""
    if not runs:
        raise ValueError("no finished runs to report on")
    summaries = {
        rung: [summarise_run(r, names, target=target, group_size=group_size, tail=tail) for r in records]
        for rung, records in runs.items()
    }
    text = table(summaries, target)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    groups = {LABELS.get(rung, rung): records for rung, records in runs.items()}
    for name, metric in (
        ("heldout_accuracy", names.accuracy),
        ("entropy", names.entropy),
        ("response_length", names.response_length),
    ):
        plot_metrics.plot(groups, [metric], out / f"{name}.png", title=TITLE)
    return text


def group_size(rung: str) -> int:
    from dapo_megatron import config as job_config

    return job_config.compose([f"experiment=ablation/{rung}"]).rollout.n_samples_per_prompt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rungs", nargs="+", default=list(RUNGS), choices=RUNGS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="rollout steps per run (default: the rungs' own)")
    parser.add_argument("--target", type=float, default=0.45, help="held-out accuracy to time (base: 0.29)")
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/ablation_runs"))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "ablation")
    parser.add_argument("--base", type=Path, default=BASE, help=f"a base warmed up on {TASK}")
    parser.add_argument("--timeout", type=float, default=3600, help="per run, seconds")
    parser.add_argument("--report-only", action="store_true", help="no runs: report on those stored")
    parser.add_argument("--accuracy-metric", default=Names.accuracy)
    parser.add_argument("--entropy-metric", default=Names.entropy)
    parser.add_argument("--response-length-metric", default=Names.response_length)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args(argv)
    names = Names(args.accuracy_metric, args.entropy_metric, args.response_length_metric)
    if not args.report_only:
        ensure_base(args.base, BASE_WARMUP, task=TASK)
        for seed in args.seeds:  # seeds outermost: a ladder cut short still has every rung at some seed
            for rung in args.rungs:
                print(f"run {rung} seed {seed}: {run_one(rung, seed, args)}", flush=True)
    runs = load_runs(args.runs_dir, args.rungs, args.seeds)
    print(report(runs, args.out, names, target=args.target, group_size=group_size(args.rungs[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
