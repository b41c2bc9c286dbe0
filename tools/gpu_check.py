#!/usr/bin/env python
"""Run this first on a GPU machine: a few DAPO training steps of a Qwen2 policy with random weights (no
download), in bf16 and, where Transformer Engine and a Hopper-or-newer GPU exist, in FP8; reports step
time, tokens/s and MFU for each.

    python tools/gpu_check.py [--steps 5] [--batch-size 8] [--seq-length 2048] [hydra overrides]
    torchrun --nproc-per-node 8 tools/gpu_check.py model=qwen2.5-7b parallel.tensor_model_parallel_size=4

The model defaults to Qwen2.5-0.5B's shapes (`model=...` picks another config group, `model.num_layers=4`
shrinks one). The steps go through the trainer's own path: the TE layer spec, megatron DDP, the
optimizer, and `Actor.train_step` (the DAPO loss through megatron-core's schedule). FP8 uses the
`model.fp8.*` settings (recipe, format, ...) with `enabled` forced on. MFU counts model FLOPs as in
`dapo_megatron/flops.py` against the dense peak of the precision used. Exits 2 without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from dapo_megatron import config as job_config
from dapo_megatron import flops
from dapo_megatron.config import JobConfig
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.models import fp8
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.trainer.actor import PolicyRows

DEFAULT_MODEL = "qwen2.5-0.5b"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per precision (after 1 untimed)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step on each DP rank")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=2048, help="tokens per sequence (half prompt, half response)")
    return parser.parse_known_args(argv)


def random_rows(batch_size: int, seq_length: int, vocab_size: int, seed: int) -> PolicyRows:
    """Random prompts + responses: the response is the second half, advantages are +-1."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_length), generator=generator)
    response_mask = torch.zeros(batch_size, seq_length - 1)
    response_mask[:, seq_length // 2:] = 1.0
    advantages = torch.randint(0, 2, (batch_size,), generator=generator).float() * 2 - 1
    return PolicyRows(tokens=tokens, response_mask=response_mask, advantages=advantages)


def measure(job: JobConfig, model_cfg: ModelConfig, layout: ParallelLayout, args: argparse.Namespace) -> float:
    """Seconds per optimizer step, the median of `args.steps` after one untimed step."""
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training

    model = wrap_for_training(build_gpt_model(model_cfg, job.parallel, layout), job.parallel)
    optimizer, scheduler = build_optimizer(model, job.optim, job.parallel, model_cfg)
    actor = Actor(model, optimizer, scheduler, job.algo, layout, vocab_size=model_cfg.vocab_size)
    rows = random_rows(args.batch_size, args.seq_length, model_cfg.vocab_size, seed=job.seed + layout.dp_rank)
    times = []
    for _ in range(args.steps + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        actor.train_step(rows, args.micro_batch_size)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    del actor, model, optimizer
    torch.cuda.empty_cache()
    return sorted(times[1:])[len(times[1:]) // 2]


def report(precision: str, seconds: float, model_cfg: ModelConfig, layout: ParallelLayout,
           args: argparse.Namespace) -> str:
    lengths = [args.seq_length] * args.batch_size * layout.dp_size
    tokens_per_s = sum(lengths) / seconds
    line = (f"{precision:>4}: {seconds * 1e3:8.1f} ms/step | {tokens_per_s:10,.0f} tokens/s "
            f"({tokens_per_s / layout.world_size:,.0f} per GPU)")
    peak = flops.peak_tflops(torch.cuda.get_device_name(), precision)
    if peak is None:
        return line + f" | MFU unknown: no {precision} peak for {torch.cuda.get_device_name()} in flops.PEAK_TFLOPS"
    utilisation = flops.mfu(flops.training_flops(model_cfg, lengths), seconds, num_gpus=layout.world_size,
                            peak_tflops_per_gpu=peak)
    return line + f" | MFU {utilisation:.1%} of {peak:.0f} TFLOP/s"


def fp8_model(job: JobConfig, world_size: int) -> tuple[ModelConfig | None, str]:
    """The FP8 variant of the model, or None and why FP8 cannot run here."""
    model_cfg = dataclasses.replace(job.model, fp8=dataclasses.replace(job.model.fp8, enabled=True))
    try:
        job_config.validate(dataclasses.replace(job, model=model_cfg), world_size)
        fp8.check_environment(model_cfg.fp8, fp8.detect_environment(), transformer_impl=model_cfg.transformer_impl)
    except (job_config.ConfigError, RuntimeError) as error:
        return None, str(error)
    return model_cfg, ""


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False). Run it on a GPU "
              "node with a CUDA build of torch, e.g. inside NVIDIA's PyTorch container (README, 'Clusters').",
              file=sys.stderr)
        return 2
    from dapo_megatron.distributed.launch import process_env
    from dapo_megatron.distributed.layout import initialize, shutdown

    if not any(override.startswith("model=") for override in overrides):
        overrides = [f"model={DEFAULT_MODEL}", *overrides]
    world_size = process_env().world_size
    job = job_config.load(overrides, world_size=world_size)
    bf16_model = dataclasses.replace(job.model, params_dtype="bfloat16",
                                     fp8=dataclasses.replace(job.model.fp8, enabled=False))
    fp8_cfg, fp8_problem = fp8_model(job, world_size)
    layout = initialize(job.parallel, job.seed)
    try:
        lines = [f"gpu_check: {job.model.name} ({flops.matmul_parameters(job.model) / 1e9:.2f}B matmul parameters), "
                 f"{layout.describe()}, {torch.cuda.get_device_name()}; {args.batch_size} x {args.seq_length} tokens "
                 f"per DP rank and step, micro-batch {args.micro_batch_size}"]
        lines.append(report("bf16", measure(job, bf16_model, layout, args), bf16_model, layout, args))
        if fp8_cfg is None:
            lines.append(f" fp8: skipped: {fp8_problem}")
        else:
            lines.append(report("fp8", measure(job, fp8_cfg, layout, args), fp8_cfg, layout, args))
        if layout.is_logging_rank:
            print("\n".join(lines), flush=True)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
