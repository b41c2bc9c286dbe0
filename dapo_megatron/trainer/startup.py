"""What a job says about itself as it starts: the software it runs, where its outputs go, its resolved
config (saved beside them as `config.yaml`)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dapo_megatron.config import JobConfig
from dapo_megatron.versions import PACKAGES, package_version

REPO = Path(__file__).resolve().parents[2]


def versions() -> dict[str, str]:
    """Installed version of each of `versions.PACKAGES`, `-` when absent."""
    return {label: package_version(label) or "-" for label in PACKAGES}


def git_commit(repo: Path = REPO) -> str:
    """The checkout's short commit, `+dirty` with uncommitted changes; `unknown` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def banner(
    job: JobConfig, *, world_size: int, device: str, engine_logs: list[Path], kernels: str
) -> list[str]:
    """The lines a job opens with: software, layout, the policy's layers and fused kernels (`kernels`),
    outputs."""
    parallel = job.parallel
    model_parallel = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    software = ", ".join(f"{name} {version}" for name, version in versions().items())
    out = Path(job.output_dir)
    logs = engine_logs[0] if len(engine_logs) == 1 else f"{engine_logs[0].parent}/sglang_engine_*.log"
    return [
        f"dapo_megatron {git_commit()}: {software}",
        f"job {job.experiment_name}: model {job.model.name}, {world_size} rank(s) on {device} = dp "
        f"{world_size // model_parallel} x tp {parallel.tensor_model_parallel_size} x pp "
        f"{parallel.pipeline_model_parallel_size}, {len(engine_logs)} SGLang engine(s), "
        f"{job.trainer.total_steps} steps",
        f"policy layers: {kernels}",
        f"outputs in {out}: config.yaml, metrics {out / 'tensorboard'} ({', '.join(job.trainer.loggers)}), "
        f"checkpoints {out / 'checkpoints'}, engine log {logs}",
    ]


def resolved_config(job: JobConfig) -> dict[str, Any]:
    """The job's every field, as plain data (for `config.yaml` and a wandb run)."""
    return dataclasses.asdict(job)


def save_config(resolved: dict[str, Any], output_dir: Path) -> Path:
    """`output_dir/config.yaml`: what this run ran with, whatever the command line said."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    return path
