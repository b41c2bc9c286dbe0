#!/usr/bin/env python
"""Rollout throughput of the SGLang CPU engine on the demo model: batched CPU attention versus SGLang's
stock per-sequence torch_native attention, in the same run.

    python bench/bench_rollout.py [--base outputs/demo_base --prompts 48 --group 16 --rounds 6]

Each round is what one demo step asks of the engine: `--prompts` prompt groups of `--group` samples at
temperature 1 through `RolloutClient.stream_groups` (HTTP, streaming, rollout log-probs returned), up to
`--max-new-tokens` tokens each. Generated tokens per second are medians over the rounds after a warm-up
round. The demo base is built first if `--base` does not exist (tools/make_demo_base.py, ~1 minute).
Prints the ratio last: `rollout_tokens_per_s_vs_stock`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(base: Path, attention: str, args: argparse.Namespace, log_dir: Path) -> list[float]:
    """Generated tokens/s per round (warm-up round excluded) with one attention implementation."""
    from dapo_megatron.data import arithmetic
    from dapo_megatron.data.tokenizer import load_tokenizer
    from dapo_megatron.rollout.client import RolloutClient
    from dapo_megatron.rollout.config import RolloutConfig
    from dapo_megatron.rollout.engine import SGLangEngine

    cfg = RolloutConfig(
        n_samples_per_prompt=args.group,
        max_response_length=args.max_new_tokens,
        max_total_tokens=16384,
        max_concurrent_requests=256,
        startup_timeout_s=600,
    )
    tokenizer = load_tokenizer(base)
    problems = arithmetic.problems("rl")
    os.environ["DAPO_CPU_ATTENTION"] = attention  # read by the engine process (backends/sglang_cpu.py)
    rates = []
    with (
        SGLangEngine(base, cfg, log_file=log_dir / f"engine-{attention}.log") as engine,
        RolloutClient(engine.url, cfg) as client,
    ):
        for round_index in range(args.rounds + 1):
            chunk = problems[round_index * args.prompts : (round_index + 1) * args.prompts]
            prompts = [(i, tokenizer(p.prompt)["input_ids"]) for i, p in enumerate(chunk)]
            started, tokens = time.perf_counter(), 0
            for _, samples in client.stream_groups(prompts, stop_token_ids=[tokenizer.eos_token_id]):
                tokens += sum(len(s.output_ids) for s in samples)
            seconds = time.perf_counter() - started
            if round_index:  # the first round pays for lazy initialisation in the engine
                rates.append(tokens / seconds)
            print(
                f"{attention:8s} round {round_index}: {tokens} tokens in {seconds:.2f}s "
                f"({tokens / seconds:.0f} tokens/s)",
                flush=True,
            )
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, default=REPO / "outputs" / "demo_base")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if not (args.base / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "make_demo_base.py"),
                "--output",
                str(args.base),
                "--force",
            ],
            check=True,
        )

    with tempfile.TemporaryDirectory() as scratch:
        stock = measure(args.base, "stock", args, Path(scratch))
        batched = measure(args.base, "batched", args, Path(scratch))
    results = {
        "prompts": args.prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "stock_tokens_per_s": stock,
        "batched_tokens_per_s": batched,
        "rollout_tokens_per_s": statistics.median(batched),
        "rollout_tokens_per_s_vs_stock": statistics.median(batched) / statistics.median(stock),
    }
    for name, rates in (("stock torch_native", stock), ("batched", batched)):
        print(
            f"{name:18s} median {statistics.median(rates):.0f} tokens/s "
            f"(min {min(rates):.0f}, max {max(rates):.0f}, {len(rates)} rounds)"
        )
    print(f"rollout_tokens_per_s_vs_stock {results['rollout_tokens_per_s_vs_stock']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
