#!/usr/bin/env python
"""Weight-sync throughput: Megatron policy -> real SGLang engine on CPU, versus a plain memory copy, for
each `rollout.sync_method` in the same run (same model, same engine).

    python bench/bench_weight_sync.py [--layers 12 --hidden 768 --vocab 32000 --repeats 3
        --methods tensor distributed]

Default: a ~152M-parameter Qwen2 in fp32 (~580 MiB). Each sync is timed end to end (begin session, per-
parameter gather, HF mapping, bucket flattening into the staging buffer, then either serialisation and the
engine's copy out of shared memory (`tensor`) or a gloo broadcast into the engine (`distributed`), the
engine's load into its model, end session). One untimed sync per method comes first, as in training, where
the one-off costs are paid at start-up: the distributed path opens its process group, the tensor path moves
the parameters into shared memory once (from then on the engine reads all but the split q/k/v where they lie).
The baseline copies the same number of bytes from one buffer to another in this process, right after each
sync, so that both see the same state of a shared machine (its memory bandwidth drifts by a third from one
minute to the next). Prints medians and, per method, `<method>_sync_bytes_per_s_vs_memcpy`: the median over
repeats of each sync's rate over the copy's that followed it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--methods", nargs="+", choices=["tensor", "distributed"], default=["tensor", "distributed"]
    )
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_megatron.data import char_tokenizer
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.config import ModelConfig
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.rollout.config import RolloutConfig
    from dapo_megatron.rollout.engine import SGLangEngine
    from dapo_megatron.rollout.weight_sync import SYNC_METHODS

    cfg = ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.hidden // 64,
        num_query_groups=max(args.hidden // 256, 1),
        vocab_size=args.vocab,
        max_position_embeddings=512,
        params_dtype="float32",
        transformer_impl="local",
    )
    nbytes = cfg.num_parameters() * 4
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = Path(scratch) / "hf"
        Qwen2ForCausalLM(Qwen2Config(**cfg.to_hf_config())).save_pretrained(hf_dir)
        char_tokenizer.save(hf_dir)
        layout = initialize(ParallelConfig(), seed=0)
        model = build_gpt_model(cfg, ParallelConfig(), layout)
        rollout = RolloutConfig(max_total_tokens=2048, startup_timeout_s=600)
        source, target = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        target.copy_(source)  # fault the target's pages in before anything is timed

        def memcpy_s() -> float:
            started = time.perf_counter()
            target.copy_(source)
            return time.perf_counter() - started

        sync_s: dict[str, list[float]] = {}
        copy_s: dict[str, list[float]] = {}
        with SGLangEngine(hf_dir, rollout, log_file=Path(scratch) / "engine.log") as engine:
            for method in args.methods:
                sync = SYNC_METHODS[method]([engine.url], cfg, layout, bucket_bytes=args.bucket_mb * 2**20)
                sync_s[method], copy_s[method] = [], []
                sync.sync(model, f"{method}-warm-up")
                for i in range(args.repeats):
                    started = time.perf_counter()
                    sync.sync(model, f"{method}-{i}")
                    sync_s[method].append(time.perf_counter() - started)
                    copy_s[method].append(memcpy_s())
                sync.close()
        shutdown()

    results: dict[str, object] = {"model_parameters": cfg.num_parameters(), "bytes": nbytes}
    print(
        f"model {cfg.num_parameters() / 1e6:.0f}M parameters, {nbytes / 2**20:.0f} MiB fp32, buckets of "
        f"{args.bucket_mb} MiB"
    )
    for method, seconds in sync_s.items():
        copies = copy_s[method]
        vs_memcpy = statistics.median(copy / sync for sync, copy in zip(seconds, copies, strict=True))
        results |= {
            f"{method}_sync_seconds": seconds,
            f"{method}_memcpy_seconds": copies,
            f"{method}_sync_bytes_per_s": nbytes / statistics.median(seconds),
            f"{method}_sync_bytes_per_s_vs_memcpy": vs_memcpy,
        }
        print(
            f"{method:<11} sync median {statistics.median(seconds):.3f}s (runs: "
            f"{', '.join(f'{s:.3f}' for s in seconds)}), memcpy after each median "
            f"{statistics.median(copies):.3f}s ({nbytes / statistics.median(copies) / 2**30:.1f} GiB/s)"
        )
    for method in sync_s:
        print(f"{method}_sync_bytes_per_s_vs_memcpy {results[f'{method}_sync_bytes_per_s_vs_memcpy']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
