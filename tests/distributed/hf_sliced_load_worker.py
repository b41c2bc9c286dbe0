"""Initialise a TP x PP model from a Hugging Face directory (run under torchrun) and write, per rank, what the
load read and its peak memory, and whether each parameter equals its shard of the fully loaded checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rchar() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models import hf_io, hf_mapping
    from dapo_megatron.models.config import ModelConfig
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.models.weights import load_hf_weights, unwrap_model

    cfg = ModelConfig.from_hf_config(
        hf_io.read_hf_config(args.hf_dir), params_dtype="float32", transformer_impl="local"
    )
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    layout = initialize(parallel, seed=0)
    model = build_gpt_model(cfg, parallel, layout)
    params = dict(unwrap_model(model).named_parameters())

    rss_before, rchar_before = rss_bytes(), rchar()
    bytes_read = load_hf_weights(model, args.hf_dir, cfg, layout)
    report = {
        "rank": layout.rank,
        "dp_rank": layout.dp_rank,
        "bytes_read": bytes_read,
        "rchar": rchar() - rchar_before,
        "peak_rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before,
        "shard_bytes": sum(p.numel() * p.element_size() for p in params.values()),
        "largest_param_bytes": max(p.numel() * p.element_size() for p in params.values()),
    }

    # The reference: the whole checkpoint in memory, fused, then sharded. One rank at a time (memory).
    mismatched = []
    for rank in range(layout.world_size):
        if rank == layout.rank:
            full = hf_mapping.hf_to_megatron(
                hf_io.load_hf_state(args.hf_dir), cfg, tensor_parallel_size=layout.tp_size
            )
            offset = hf_mapping.layer_range(cfg, layout.pp_size, layout.pp_rank).start
            for name, param in params.items():
                canonical = hf_mapping.local_to_global_name(name, offset)
                expected = hf_mapping.shard_for_tensor_parallel(
                    canonical, full[canonical], cfg, layout.tp_size, layout.tp_rank
                )
                if not torch.equal(param, expected):
                    mismatched.append(canonical)
            report["checked"], report["mismatched"] = len(params), mismatched
            del full
        torch.distributed.barrier()
    Path(args.out, f"rank{layout.rank}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
