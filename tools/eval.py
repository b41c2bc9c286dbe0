#!/usr/bin/env python
"""Evaluate a policy with the rollout engine: k samples per problem, avg@k and pass@k.

    python tools/eval.py --model DIR [--checkpoint CKPT] [hydra overrides, e.g. data.eval_files=[aime.parquet]
        eval.samples_per_problem=32 eval.temperature=1.0 eval.top_p=0.7 rollout.max_response_length=20480]

--model is a Hugging Face directory (weights, config and tokenizer). With --checkpoint, the weights come
from a torch_dist checkpoint instead (exported to a temporary HF directory next to --output-dir first).
Without data.eval_files the demo's held-out arithmetic problems are used. DAPO's AIME protocol is 30
problems x 32 samples at temperature 1.0, top_p 0.7 (avg@32).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dapo_megatron import config as job_config
from dapo_megatron.data.tokenizer import load_tokenizer
from dapo_megatron.rewards.pool import RewardPool
from dapo_megatron.rollout.client import RolloutClient
from dapo_megatron.rollout.engine import SGLangEngine, liveness_check
from dapo_megatron.trainer.evaluate import evaluate
from dapo_megatron.trainer.prompts import build_prompt_sources


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF directory: tokenizer and config (and weights)")
    parser.add_argument("--checkpoint", help="torch_dist checkpoint whose weights to evaluate instead")
    parser.add_argument("--output-json", help="also write the metrics here")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    job = job_config.load([f"model.hf_dir={args.model}", *overrides])
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(args.model)
        if args.checkpoint:
            model_dir = Path(scratch) / "hf"
            subprocess.run([sys.executable, str(Path(__file__).with_name("convert_megatron_to_hf.py")),
                            "--checkpoint", args.checkpoint, "--output", str(model_dir),
                            "--hf-config-dir", args.model], check=True)
        tokenizer = load_tokenizer(model_dir)
        _, problems = build_prompt_sources(job, tokenizer)
        with SGLangEngine(model_dir, job.rollout, log_file=Path(scratch) / "engine.log") as engine, \
                RewardPool(job.reward) as rewards:
            client = RolloutClient(engine.url, job.rollout, on_error=liveness_check([engine]))
            metrics = evaluate(client, problems, rewards, job.eval,
                               decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                               max_new_tokens=job.eval.max_response_length or job.rollout.max_response_length,
                               stop_token_ids=[tokenizer.eos_token_id], progress=True)
            client.close()
    k = job.eval.samples_per_problem
    print(f"{len(problems)} problems x {k} samples (T={job.eval.temperature}, top_p={job.eval.top_p}): "
          f"avg@{k} {metrics['eval/accuracy']:.4f}  pass@{k} {metrics[f'eval/pass@{k}']:.4f}  "
          f"mean response length {metrics['eval/response_length']:.1f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
