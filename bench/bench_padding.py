"""Padding: how many of the tokens the model computes are real, with fixed-size micro-batches (rows in
batch order, each micro-batch cut to its longest row) versus token-budget micro-batches planned over
the mini-batch and balanced across data-parallel ranks (`trainer.max_tokens_per_micro_batch`).

Both plans come from the trainer's own `plan_rank` (what `split_rows` hands each rank); a micro-batch
computes its rows x its longest row (`packing.padded_tokens`, the shape `PolicyRows.micro_batches`
builds; before FP8's alignment padding). A row's real tokens are the positions up to its last token.

Lengths are a model, not measured data. DAPO's recipe caps prompts at 2048 and responses at 20480
tokens, with the overlong penalty starting at 16384; response lengths grow during training. Prompts are
uniform in [100, 600] tokens (DAPO-Math problems in the chat template) and responses log-normal,
clipped at 20480 (the truncated samples pile up there): early training (median 1000, sigma 1.0), mid
(median 3000, sigma 0.9) and late (median 6000, sigma 0.7); the bench prints each model's mean and
truncated share. Each mini-batch holds 512 rows (32 prompts x 16 samples, the paper's mini-batch), as
in one rollout step of 16 optimizer steps.

The fixed baseline uses the micro-batch size that gives the same number of forward passes per rank as
the token budget, so per-pass overheads match and only padding differs; micro_batch_size=1 (the
recipes' setting for a 22528-token budget) has no padding but runs every row alone.

Usage: ``python bench/bench_padding.py [--ranks 8] [--budget 22528] [--mini-batches 16]``.
The last lines printed are ``real_token_fraction`` (token budget, mid-training lengths) and
``real_token_fraction_vs_fixed``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from dapo_megatron.trainer.batch import plan_rank  # noqa: E402
from dapo_megatron.trainer.config import TrainerConfig  # noqa: E402
from dapo_megatron.trainer.packing import padded_tokens  # noqa: E402

MAX_PROMPT, MAX_RESPONSE = 2048, 20480
ROWS_PER_MINI_BATCH = 512
PHASES = {"early": (1000.0, 1.0), "mid": (3000.0, 0.9), "late": (6000.0, 0.7)}  # median, sigma


def sample_widths(rows: int, median: float, sigma: float, rng: random.Random) -> tuple[list[int], list[int]]:
    """(widths, response lengths) of a mini-batch with DAPO-like lengths (module docstring). A row's
    width, the label positions the model computes for it, is prompt + response - 1."""
    responses = [max(1, min(MAX_RESPONSE, int(rng.lognormvariate(0.0, sigma) * median))) for _ in range(rows)]
    return [rng.randint(100, 600) + response - 1 for response in responses], responses


@dataclass
class Measured:
    real: int = 0
    computed: int = 0
    passes: int = 0
    largest: int = 0
    """Tokens of the largest micro-batch (what activation memory must hold)."""
    imbalance: list[float] = field(default_factory=list)
    """Per mini-batch: max / mean computed tokens over ranks."""

    @property
    def fraction(self) -> float:
        return self.real / self.computed


def measure(batches: list[list[int]], ranks: int, trainer: TrainerConfig) -> Measured:
    """Real and computed tokens of `batches` (the widths of one mini-batch each) over `ranks` DP ranks."""
    out = Measured()
    for widths in batches:
        out.real += sum(widths)
        per_rank = []
        for rank in range(ranks):
            sizes = [
                padded_tokens(mb, widths) for step in plan_rank(widths, ranks, rank, trainer) for mb in step
            ]
            per_rank.append(sum(sizes))
            out.passes += len(sizes)
            out.largest = max(out.largest, *sizes)
        out.computed += sum(per_rank)
        out.imbalance.append(max(per_rank) / statistics.mean(per_rank))
    return out


def report(name: str, m: Measured, ranks: int, batches: int) -> str:
    return (
        f"  {name:<34} real {m.fraction:6.3f}  passes/rank/step {m.passes / ranks / batches:6.1f}  "
        f"largest micro-batch {m.largest:>7} tokens  DP max/mean {statistics.mean(m.imbalance):.3f} "
        f"(worst {max(m.imbalance):.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks")
    parser.add_argument(
        "--budget",
        type=int,
        default=MAX_PROMPT + MAX_RESPONSE,
        help="trainer.max_tokens_per_micro_batch (default: one longest row, 22528)",
    )
    parser.add_argument(
        "--mini-batches", type=int, default=16, help="mini-batches of 512 rows per length model"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    budget = TrainerConfig(train_batch_size=1, ppo_mini_batch_size=1, max_tokens_per_micro_batch=args.budget)
    results: dict[str, tuple[Measured, Measured]] = {}
    for phase, (median, sigma) in PHASES.items():
        rng = random.Random(args.seed)
        sampled = [sample_widths(ROWS_PER_MINI_BATCH, median, sigma, rng) for _ in range(args.mini_batches)]
        batches = [widths for widths, _ in sampled]
        planned = measure(batches, args.ranks, budget)
        # The fixed size with as many forward passes per rank as the plan: only padding differs.
        passes = planned.passes / args.ranks / args.mini_batches
        size = max(1, round(ROWS_PER_MINI_BATCH / args.ranks / passes))
        fixed = measure(
            batches,
            args.ranks,
            TrainerConfig(train_batch_size=1, ppo_mini_batch_size=1, micro_batch_size=size),
        )
        one_row = measure(
            batches, args.ranks, TrainerConfig(train_batch_size=1, ppo_mini_batch_size=1, micro_batch_size=1)
        )
        responses = [length for _, lengths in sampled for length in lengths]
        print(
            f"{phase}: responses median {statistics.median(responses):.0f} mean "
            f"{statistics.mean(responses):.0f} tokens, "
            f"{sum(r >= MAX_RESPONSE for r in responses) / len(responses):.1%} truncated; {args.ranks} DP "
            f"ranks, {args.mini_batches} x {ROWS_PER_MINI_BATCH} rows"
        )
        print(report(f"fixed, micro_batch_size={size}", fixed, args.ranks, args.mini_batches))
        print(report("fixed, micro_batch_size=1", one_row, args.ranks, args.mini_batches))
        print(report(f"token budget {args.budget}", planned, args.ranks, args.mini_batches))
        results[phase] = (fixed, planned)

    fixed, planned = results["mid"]
    print(f"dp_imbalance_max_over_mean {statistics.mean(planned.imbalance):.3f}")
    print(f"real_token_fraction_fixed {fixed.fraction:.3f}")
    print(f"real_token_fraction {planned.fraction:.3f}")
    print(f"real_token_fraction_vs_fixed {planned.fraction / fixed.fraction:.3f}")


if __name__ == "__main__":
    main()
