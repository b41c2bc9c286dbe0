#!/usr/bin/env python
"""Dynamic-sampling cost: samples generated per sample trained on, streaming versus batch-synchronous, on the
demo.

    python bench/bench_dynamic_sampling.py [--steps 30 --seed 0 --base outputs/demo_base] [--quick]
        [--json PATH]

Two demo trainings, one after the other, same base, seed, batch and steps:
  * streaming (the default `trainer.dynamic_sampling_mode`): each prompt group is judged the moment it
    completes and admitted in draw order, the requests still in flight are aborted once the batch is full,
    and the prompts drawn past it go first next step (finished groups carried over, aborted ones generated
    again);
  * batch_sync (verl's recipe): `gen_batch_size` = 3 x `train_batch_size` prompts per round, wait for all,
    filter, truncate to the batch (the surplus is dropped), another round if the batch is not full.
Per step the trainer logs `dynamic_sampling/samples_per_kept` (samples generated, aborted ones included,
over samples trained on). The ratio streaming / batch_sync of its median over steps is printed last as
`generated_per_trained_vs_batch_sync` (target <= 0.7), with the held-out greedy accuracy of both runs after
the same steps: the saving only counts at equal accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from trainer_runs import DEMO_BASE, describe, ensure_base, fmt, ratio, spread, task_seed, train_run

from dapo_megatron.trainer.evaluate import eval_accuracy

MODES = ("streaming", "batch_sync")


def run_mode(mode: str, args: argparse.Namespace, scratch: Path) -> dict[str, object]:
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
        # streaming submits prompts as slots free up, so its round size only bounds the search;
        # batch_sync generates exactly this many per round: verl's 3 x the batch.
        f"trainer.gen_batch_size={3 * args.prompts if mode == 'batch_sync' else args.prompts * 3 // 2}",
    ]
    records = [r.metrics for r in train_run(overrides, scratch / mode, timeout=args.timeout)]
    steps = [r for r in records if r["step"] > 0 and "dynamic_sampling/samples_per_kept" in r]
    evals = [accuracy for r in records if (accuracy := eval_accuracy(r)) is not None]
    per_step = [r["dynamic_sampling/samples_per_kept"] for r in steps]
    return {
        "samples_per_kept": spread(per_step),
        "samples_per_kept_mean": statistics.mean(per_step),
        "samples_per_kept_per_step": per_step,
        "keep_ratio": spread([r["dynamic_sampling/keep_ratio"] for r in steps]),
        "gen_seconds": spread([r["timing_s/gen"] for r in steps]),
        "eval_accuracy_before": evals[0],
        "eval_accuracy_after": evals[-1],
    }


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
        results = {mode: run_mode(mode, args, Path(scratch)) for mode in MODES}
    for mode, result in results.items():
        print(
            f"{mode:10s} {describe('generated per trained', result['samples_per_kept'])}, "
            f"mean {result['samples_per_kept_mean']:.3f}; {describe('keep ratio', result['keep_ratio'])}; "
            f"eval acc {result['eval_accuracy_before']:.3f} -> {result['eval_accuracy_after']:.3f}"
        )
    streaming, batch_sync = results["streaming"], results["batch_sync"]
    summary = {
        "generated_per_trained_vs_batch_sync": ratio(
            streaming["samples_per_kept"]["median"], batch_sync["samples_per_kept"]["median"]
        ),
        "generated_per_trained_vs_batch_sync_mean": ratio(
            streaming["samples_per_kept_mean"], batch_sync["samples_per_kept_mean"]
        ),
        "eval_accuracy_streaming": streaming["eval_accuracy_after"],
        "eval_accuracy_batch_sync": batch_sync["eval_accuracy_after"],
    }
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
