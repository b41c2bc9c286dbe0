#!/usr/bin/env python
"""How close the policy update comes to the machine's matmul speed: the update's model FLOPs per second
over the fastest fp32 GEMM the same cores run at the model's own shapes, both measured in this run.

    python bench/bench_update_flops.py [--size large|demo] [--threads N] [--steps 3] [--json PATH]

The update is the trainer's own (`trainer.actor.update_policy` on a `trainer.policy.Policy`: megatron-core's
GPT model with local layers, the DAPO loss, AdamW), on one gloo rank, on a batch shaped like the end-to-end
benchmark's (bench_e2e_trl.py's sizes: prompts x samples rows, `ppo_mini_batch_size` prompts per optimizer
step, π_old from the engine, so no extra forward pass): random tokens and advantages, response lengths spread
over the top quarter of the cap as the sizes' real responses are. Model FLOPs are
`dapo_megatron.flops.training_flops` (6 x matmul parameters x tokens plus attention, the convention GPU MFU
uses), so recomputation or wasted padding would count against the update, not for it.

The baseline: `torch.mm` on every weight matrix's GEMM of a micro-batch (QKV, attention output, the SwiGLU
pair, its down projection, the output layer) forward and both backward shapes, at the same threads; its
fastest shape is the peak. Printed last: `train_flops_fraction_of_gemm_peak` (target >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_e2e_trl import LARGE_MODEL, SIZES
from trainer_runs import fmt

from dapo_megatron import config as job_config
from dapo_megatron import flops
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.records import PolicyRows

PROMPT_TOKENS = 32


def gemm_shapes(model: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every weight matrix's GEMM over `tokens` tokens: forward (tokens x in -> out), the input
    gradient (tokens x out -> in) and the weight gradient (in x tokens -> out)."""
    weights = [*flops.layer_weights(model), (model.hidden_size, model.vocab_size)]
    shapes = set()
    for fan_in, fan_out in weights:
        shapes |= {(tokens, fan_in, fan_out), (tokens, fan_out, fan_in), (fan_in, tokens, fan_out)}
    return sorted(shapes)


def gemm_peak(shapes: list[tuple[int, int, int]], repeats: int) -> tuple[float, tuple[int, int, int]]:
    """The fastest FLOP/s of `torch.mm` over `shapes` (fp32, median of `repeats` timings each) and its
    shape."""
    best = (0.0, shapes[0])
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)  # warm-up: first-touch of the output, the library's dispatch
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            torch.mm(a, b)
            seconds.append(time.perf_counter() - started)
        best = max(best, (2 * m * k * n / statistics.median(seconds), (m, k, n)))
    return best


def batch(prompts: int, group: int, cap: int, vocab: int, generator: torch.Generator) -> PolicyRows:
    """prompts x group rows of a PROMPT_TOKENS prompt and a response of 3/4 cap to cap tokens, right-padded;
    π_old as the engine would give it."""
    rows = prompts * group
    lengths = torch.randint(cap * 3 // 4, cap + 1, (rows,), generator=generator)
    width = PROMPT_TOKENS + cap
    tokens = torch.randint(0, vocab, (rows, width), generator=generator)
    positions = torch.arange(width - 1)
    mask = (positions >= PROMPT_TOKENS - 1) & (positions < PROMPT_TOKENS - 1 + lengths[:, None])
    tokens[:, 1:][~mask & (positions >= PROMPT_TOKENS - 1)] = 0
    return PolicyRows(
        tokens=tokens,
        response_mask=mask.float(),
        advantages=torch.randn(rows, generator=generator),
        rollout_log_prob=torch.where(mask, -torch.rand(rows, width - 1, generator=generator) * 3, 0.0),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=list(SIZES), default="large")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads of both the update and the GEMMs"
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="timed rollout steps' updates (after one untimed)"
    )
    parser.add_argument("--gemm-repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = SIZES[args.size]

    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.trainer.actor import update_policy
    from dapo_megatron.trainer.batch import split_rows
    from dapo_megatron.trainer.policy import Policy

    job = job_config.load(
        [
            "experiment=demo",
            *(LARGE_MODEL if args.size == "large" else ()),
            f"trainer.train_batch_size={size.prompts}",
            f"trainer.ppo_mini_batch_size={size.mini_batch}",
            f"rollout.n_samples_per_prompt={size.group}",
            f"rollout.max_response_length={size.max_new_tokens}",
        ]
    )
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{scratch}/store", rank=0, world_size=1
        )
        try:
            layout = initialize(job.parallel, seed=0)
            policy = Policy(job, layout)
            updates = []
            for step in range(args.steps + 1):
                rows = batch(size.prompts, size.group, size.max_new_tokens, job.model.vocab_size, generator)
                share = split_rows(rows, 1, 0, job.trainer)
                lengths = (rows.widths() + 1).tolist()
                seconds = update_policy(policy.actor, share, off_policy=True)["timing_s/update_actor"]
                if step:  # the first pays for allocations and Adam's state
                    updates.append(flops.training_flops(job.model, lengths) / seconds)
                print(f"update {step}: {seconds:.2f}s, {sum(lengths)} tokens", flush=True)
            micro_rows = max(max(micro) for _, micro in share.mini_batches())
            micro_tokens = micro_rows * share.rows.tokens.shape[1]
        finally:
            shutdown()
    peak, shape = gemm_peak(gemm_shapes(job.model, micro_tokens), args.gemm_repeats)
    update = statistics.median(updates)
    print(
        f"{size.name}: update {update / 1e9:.1f} GFLOP/s (model FLOPs, median of {len(updates)}), fp32 GEMM "
        f"peak {peak / 1e9:.1f} GFLOP/s at {shape} on {args.threads} thread(s)"
    )
    fraction = update / peak
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "size": size.name,
                    "threads": args.threads,
                    "update_flops_per_s": updates,
                    "gemm_peak_flops_per_s": peak,
                    "gemm_peak_shape": shape,
                    "train_flops_fraction_of_gemm_peak": fraction,
                },
                indent=2,
            )
        )
    print(f"train_flops_fraction_of_gemm_peak {fmt(fraction)}")


if __name__ == "__main__":
    main()
