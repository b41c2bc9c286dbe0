"""Evaluate a policy with the rollout engine: k samples per problem, avg@k and pass@k.

    dapo-eval --model DIR [--checkpoint CKPT] [--device auto|cpu|cuda] [--output-json PATH]
        [hydra overrides, e.g. experiment=dapo_qwen2.5_7b data.eval_files=[aime.parquet,math500.parquet]
        eval.samples_per_problem=32 eval.temperature=1.0 eval.top_p=0.7 rollout.max_response_length=20480]

--model is a Hugging Face directory (weights, config and tokenizer). With --checkpoint, the weights come
from a torch_dist checkpoint instead (exported to a temporary HF directory first). Without data.eval_files
the demo's held-out arithmetic problems are used. DAPO's AIME protocol is 30 problems x 32 samples at
temperature 1.0, top_p 0.7 (avg@32). Problems from several data sources are also reported per source
(`eval/<data_source>/accuracy`, `eval/<data_source>/pass@k`).

On GPUs the engines take the recipe's rollout layout on this node: `rollout.num_engines` engines (0 = as many
as fit) of `rollout.engine_tp_size` GPUs each, side by side from GPU 0, the problems spread over them. Nothing
trains beside them, so `rollout.mem_fraction_static` may be raised (e.g. 0.85). On CPU one engine runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dapo_megatron import backends
from dapo_megatron import config as job_config
from dapo_megatron.backends.base import Backend
from dapo_megatron.cli import reports_config_errors
from dapo_megatron.config import ConfigError, JobConfig
from dapo_megatron.data.tokenizer import load_tokenizer
from dapo_megatron.rewards.pool import RewardPool
from dapo_megatron.rollout.client import RolloutClient
from dapo_megatron.rollout.engine import SGLangEngine
from dapo_megatron.rollout.engine_record import liveness_check
from dapo_megatron.trainer.evaluate import OVERALL, by_source, evaluate
from dapo_megatron.trainer.fleet import rollout_config
from dapo_megatron.trainer.prompts import build_prompt_sources

T = TypeVar("T")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF directory: tokenizer and config (and weights)")
    parser.add_argument("--checkpoint", help="torch_dist checkpoint whose weights to evaluate instead")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the engines run (auto: cuda when a GPU is visible)",
    )
    parser.add_argument("--output-json", help="also write the metrics here")
    return parser.parse_known_args(argv)


def load_job(model: str, overrides: list[str]) -> JobConfig:
    """The config, validated as the job it plans (`cluster.*`, the dry run's world size): evaluation trains
    nothing, so this one process is not the recipe's world (a 32B recipe's tensor parallelism needs 8
    ranks)."""
    job = job_config.to_job_config(job_config.compose([f"model.hf_dir={model}", *overrides]))
    job_config.validate(job, world_size=job.cluster.world_size)
    return job


def eval_engines(
    job: JobConfig, model_dir: Path, log_dir: Path, *, backend: Backend, gpus: int
) -> list[SGLangEngine]:
    """The engines to evaluate with, not started: the backend's engines on this node
    (`Backend.node_engine_gpus`: on CUDA the rollout layout on its `gpus` GPUs, on CPU one engine)."""
    # The dtype stays rollout.dtype: `auto` is then the evaluated model's own (float32 on CPU), which need not
    # be the policy's params_dtype of the config given.
    rollout = dataclasses.replace(rollout_config(job), dtype=job.rollout.dtype)
    first_gpus = backend.node_engine_gpus(gpus, rollout.engine_tp_size, rollout.num_engines)
    return [
        SGLangEngine(
            model_dir,
            rollout,
            log_file=log_dir / ("engine.log" if len(first_gpus) == 1 else f"engine_{index}.log"),
            backend=backend,
            base_gpu_id=first_gpu,
            index=index,
        )
        for index, first_gpu in enumerate(first_gpus)
    ]


def resolve_device(choice: str) -> tuple[Backend, int]:
    """(backend, visible GPUs) for --device."""
    backend = backends.detect() if choice == "auto" else backends.named(choice)
    gpus = backend.device_count()
    if choice == "cuda" and not gpus:
        raise SystemExit(
            "--device cuda, but no GPU is visible (CUDA_VISIBLE_DEVICES, driver); use --device cpu"
        )
    return backend, gpus


def _layout_or_exit(build: Callable[[], T]) -> T:
    try:
        return build()
    except ValueError as error:  # the message names the field and the fix
        raise ConfigError(str(error)) from None


@reports_config_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    job = load_job(args.model, overrides)
    backend, gpus = resolve_device(args.device)
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as running:
        model_dir = Path(args.model)
        if args.checkpoint:
            # A layout that does not fit is refused before an export of minutes (32B).
            _layout_or_exit(lambda: eval_engines(job, model_dir, Path(scratch), backend=backend, gpus=gpus))
            model_dir = Path(scratch) / "hf"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "dapo_megatron.commands.convert_megatron_to_hf",
                    "--checkpoint",
                    args.checkpoint,
                    "--output",
                    str(model_dir),
                    "--hf-config-dir",
                    args.model,
                ],
                check=True,
            )
        engines = _layout_or_exit(
            lambda: eval_engines(job, model_dir, Path(scratch), backend=backend, gpus=gpus)
        )
        for engine in engines:  # all load their weights at once
            running.callback(engine.shutdown)
            engine.launch()
        for engine in engines:
            engine.wait_until_ready()
        tokenizer = load_tokenizer(model_dir)
        _, problems = build_prompt_sources(job, tokenizer)
        rewards = running.enter_context(RewardPool(job.reward))
        client = running.enter_context(
            RolloutClient(
                [engine.url for engine in engines], engines[0].cfg, on_error=liveness_check(engines)
            )
        )
        metrics = evaluate(
            client,
            problems,
            rewards,
            job.eval,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            max_new_tokens=job.eval.max_response_length or job.rollout.max_response_length,
            stop_token_ids=[tokenizer.eos_token_id],
            progress=True,
        )
    print(report(metrics, problems=len(problems), job=job, engines=len(engines), device=backend.name))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(metrics, indent=2))
    return 0


def report(metrics: dict[str, float], *, problems: int, job: JobConfig, engines: int, device: str) -> str:
    """The console summary: overall, then one line per data source when there are several."""
    k, cfg = job.eval.samples_per_problem, job.eval
    sources = by_source(metrics, k)
    overall = sources.pop(OVERALL) if OVERALL in sources else next(iter(sources.values()))

    def scores(summary: dict[str, float]) -> str:
        passed = f"  pass@{k} {summary['pass']:.4f}" if "pass" in summary else ""
        return f"avg@{k} {summary['avg']:.4f}{passed}"

    lines = [
        f"{problems} problems x {k} samples (T={cfg.temperature}, top_p={cfg.top_p}) on {engines} {device} "
        f"engine(s): {scores(overall)}  mean response length {overall['response_length']:.1f}"
    ]
    if len(sources) > 1:
        lines += [f"  {source}: {scores(summary)}" for source, summary in sorted(sources.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
