#!/usr/bin/env python
"""Dynamic-sampling cost: samples generated per sample trained on, streaming versus batch-synchronous, on the
demo.

    python bench/bench_dynamic_sampling.py [--steps 30 --seed 0 --base outputs/demo_base] [--quick]
        [--json PATH]

Three demo trainings, one after the other, same base, seed, batch and steps:
  * streaming (the default `trainer.dynamic_sampling_mode`): each prompt group is judged the moment it
    completes and admitted in draw order, the requests still in flight are aborted once the batch is full,
    and the prompts drawn past it go first next step (finished groups carried over, aborted ones generated
    again);
  * batch_sync (verl's recipe): `gen_batch_size` = 3 x `train_batch_size` prompts per round, wait for all,
    filter, truncate to the batch (the surplus is dropped), another round if the batch is not full;
  * batch_sync at its leanest: `gen_batch_size` = the fewest prompts that fill the batch in one round at the
    lowest keep ratio the streaming run saw (prompts / that ratio, rounded up). Any fewer and the steps with
    that keep ratio need a second round; verl's 3x is this plus a margin for keep ratios nobody measured.
Per step the trainer logs `dynamic_sampling/samples_per_kept` (samples generated, aborted ones included,
over samples trained on). The ratio streaming / batch_sync of its median over steps is printed last as
`generated_per_trained_vs_batch_sync` (target <= 0.7) and against the leanest batch_sync as
`generated_per_trained_vs_batch_sync_min`, with every run's held-out greedy accuracy after the same steps:
the saving only counts at equal accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from trainer_runs import DEMO_BASE, describe, ensure_base, fmt, ratio, spread, task_seed, train_run

from dapo_megatron.trainer.evaluate import eval_accuracy


def run_mode(mode: str, gen_batch: int, args: argparse.Namespace, scratch: Path, name: str) -> dict[str, Any]:
    """One demo training in `trainer.dynamic_sampling_mode=mode` drawing `gen_batch` prompts per round."""
    overrides = [
        f"model.hf_dir={args.base}",
        f"seed={args.seed}",
        f"data.task_seed={task_seed(args.base)}",
        f"trainer.total_steps={args.steps}",
        f"trainer.dynamic_sampling_mode={mode}",
        f"trainer.train_batch_size={args.prompts}",
        f"trainer.ppo_mini_batch_size={args.mini_batch}",
        f"eval.every={args.steps}",
        f"eval.num_problems={args.eval_problems}",
        "trainer.save_every=0",
        f"trainer.gen_batch_size={gen_batch}",
    ]
    records = [r.metrics for r in train_run(overrides, scratch / name, timeout=args.timeout)]
    steps = [r for r in records if r["step"] > 0 and "dynamic_sampling/samples_per_kept" in r]
    evals = [accuracy for r in records if (accuracy := eval_accuracy(r)) is not None]
    per_step = [r["dynamic_sampling/samples_per_kept"] for r in steps]
    return {
        "samples_per_kept": spread(per_step),
        "samples_per_kept_mean": statistics.mean(per_step),
        "samples_per_kept_per_step": per_step,
        "gen_batch_size": gen_batch,
        "keep_ratio": spread([r["dynamic_sampling/keep_ratio"] for r in steps]),
        # Of the steps that judged a group (a step filled from carried-over groups alone judges none).
        "lowest_keep_ratio": min(
            (r["dynamic_sampling/keep_ratio"] for r in steps if r["dynamic_sampling/judged_groups"]),
            default=1.0,
        ),
        "steps_with_more_rounds": sum(r["dynamic_sampling/gen_rounds"] > 1 for r in steps),
        "gen_seconds": spread([r["timing_s/gen"] for r in steps]),
        "eval_accuracy_before": evals[0],
        "eval_accuracy_after": evals[-1],
    }


def leanest_gen_batch(prompts: int, keep_ratio: float) -> int:
    """The fewest prompts per round that still fill a batch of `prompts` groups in one round when a share
    `keep_ratio` of the groups is kept."""
    if keep_ratio <= 0:
        raise ValueError("a step kept no group: no generation batch fills the batch in one round")
    return math.ceil(prompts / keep_ratio - 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, default=DEMO_BASE, help="demo base (built if missing)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32, help="prompt groups trained per step (the demo's)")
    parser.add_argument("--mini-batch", type=int, default=8, help="prompt groups per optimizer step")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per training run")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 small steps per mode")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts, args.mini_batch, args.eval_problems = 2, 8, 4, 20
    ensure_base(args.base)

    with tempfile.TemporaryDirectory() as scratch:
        # Streaming submits prompts as slots free up, so its round size only bounds the search.
        streaming = run_mode("streaming", args.prompts * 3 // 2, args, Path(scratch), "streaming")
        batch_sync = run_mode("batch_sync", 3 * args.prompts, args, Path(scratch), "batch_sync")
        leanest = leanest_gen_batch(args.prompts, streaming["lowest_keep_ratio"])
        batch_sync_min = run_mode("batch_sync", leanest, args, Path(scratch), "batch_sync_min")
    results = {"streaming": streaming, "batch_sync": batch_sync, "batch_sync_min": batch_sync_min}
    for name, result in results.items():
        print(
            f"{name:14s} gen batch {result['gen_batch_size']}: "
            f"{describe('generated per trained', result['samples_per_kept'])}, "
            f"mean {result['samples_per_kept_mean']:.3f}; {describe('keep ratio', result['keep_ratio'])}; "
            f"steps with more than one round {result['steps_with_more_rounds']}; "
            f"eval acc {result['eval_accuracy_before']:.3f} -> {result['eval_accuracy_after']:.3f}"
        )
    summary: dict[str, float | None] = {}
    for name, baseline in (("batch_sync", batch_sync), ("batch_sync_min", batch_sync_min)):
        summary[f"generated_per_trained_vs_{name}"] = ratio(
            streaming["samples_per_kept"]["median"], baseline["samples_per_kept"]["median"]
        )
        summary[f"generated_per_trained_vs_{name}_mean"] = ratio(
            streaming["samples_per_kept_mean"], baseline["samples_per_kept_mean"]
        )
    for name, result in results.items():
        summary[f"eval_accuracy_{name}"] = result["eval_accuracy_after"]
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"steps": args.steps, "seed": args.seed, "quick": args.quick, "modes": results, **summary},
                indent=2,
            )
        )
    for key, value in summary.items():
        print(f"{key} {fmt(value)}")


if __name__ == "__main__":
    main()
