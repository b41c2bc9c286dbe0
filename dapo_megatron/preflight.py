"""Checks of what a job reads and writes on disk, run before anything expensive starts.

`validate` checks the config against itself; this module checks it against the file system: the data
files, `model.hf_dir` (and its config.json's shapes against `model.*`), `trainer.load`, the resume
checkpoint, and that the output directory does not hold another run's checkpoints. A typo would otherwise
surface only after the engine and the policy have started, minutes into a large job.

Tools that compose a config without running it (tests, plan_memory) do not call this. The trainer calls
`check_job` at job start; the dry run reports the same problems but fails only on those that are not a
missing path (`Problem.missing`), since it may run where only the cluster's files are missing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dapo_megatron import checkpoint
from dapo_megatron.config import ConfigError, JobConfig
from dapo_megatron.models.config import ModelConfig

__all__ = ["Problem", "check_job", "find_problems"]

# The config.json fields that fix the weights' shapes, by their ModelConfig names.
_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "tie_word_embeddings",
)


@dataclass(frozen=True)
class Problem:
    message: str
    missing: bool
    """A path that does not exist here (the dry run may run where the cluster's files are not)."""


def find_problems(job: JobConfig) -> list[Problem]:
    """Every problem with the job's inputs and output directory, in config order."""
    problems: list[Problem] = []
    for field_name in ("train_files", "eval_files"):
        for path in getattr(job.data, field_name):
            problems += _data_file_problems(f"data.{field_name}", Path(path))
    if job.model.hf_dir:
        problems += _hf_dir_problems(Path(job.model.hf_dir), job.model)
    if job.trainer.load:
        problems += _checkpoint_problems("trainer.load", Path(job.trainer.load))
    if job.trainer.resume not in ("auto", "never"):
        problems += _checkpoint_problems("trainer.resume", Path(job.trainer.resume))
    problems += _output_problems(job)
    return problems


def check_job(job: JobConfig) -> None:
    """Raise ConfigError listing every problem (job start: every path must exist here)."""
    problems = find_problems(job)
    if problems:
        raise ConfigError("\n".join(problem.message for problem in problems))


def _readable(field_name: str, path: Path, kind: str) -> Problem | None:
    is_kind = path.is_dir() if kind == "directory" else path.is_file()
    if not path.exists():
        return Problem(
            f"{field_name}: {path} does not exist (resolved from {Path.cwd()}); fix the path", missing=True
        )
    if not is_kind:
        return Problem(f"{field_name}: {path} is not a {kind}", missing=False)
    if not os.access(path, os.R_OK | (os.X_OK if kind == "directory" else 0)):
        return Problem(f"{field_name}: {path} is not readable by this user", missing=False)
    return None


def _data_file_problems(field_name: str, path: Path) -> list[Problem]:
    problem = _readable(field_name, path, "file")
    if problem is not None:
        return [problem]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as error:  # pyarrow raises several types for a damaged file
            return [Problem(f"{field_name}: {path} is not a readable parquet file ({error})", missing=False)]
        empty = rows == 0
    else:
        with path.open("rb") as stream:
            empty = not any(line.strip() for line in stream)
    return [Problem(f"{field_name}: {path} holds no rows", missing=False)] if empty else []


def _hf_dir_problems(path: Path, model: ModelConfig) -> list[Problem]:
    problem = _readable("model.hf_dir", path, "directory")
    if problem is not None:
        return [problem]
    config_file = path / "config.json"
    if not config_file.is_file():
        return [
            Problem(
                f"model.hf_dir: {path} has no config.json; point it at a Hugging Face model directory",
                missing=False,
            )
        ]
    try:
        saved = ModelConfig.from_hf_config(json.loads(config_file.read_text()))
    except (ValueError, KeyError, TypeError) as error:
        return [Problem(f"model.hf_dir: cannot read {config_file}: {error}", missing=False)]
    differing = [
        f"model.{name}={getattr(model, name)} but config.json has {getattr(saved, name)}"
        for name in _SHAPE_FIELDS
        if getattr(model, name) != getattr(saved, name)
    ]
    if differing:
        return [
            Problem(
                f"model.hf_dir: {path} does not match the model config: {'; '.join(differing)}. Choose the "
                "model=... preset of this checkpoint or fix model.hf_dir",
                missing=False,
            )
        ]
    return []


def _checkpoint_problems(field_name: str, path: Path) -> list[Problem]:
    problem = _readable(field_name, path, "directory")
    if problem is not None:
        return [problem]
    try:
        checkpoint.resolve(path)
    except (FileNotFoundError, ValueError) as error:
        return [Problem(f"{field_name}: {error}", missing=False)]
    return []


def _output_problems(job: JobConfig) -> list[Problem]:
    root = Path(job.output_dir) / "checkpoints"
    steps = checkpoint.list_steps(root)
    if job.trainer.overwrite or not steps or job.trainer.resume not in ("auto", "never"):
        return []
    if job.trainer.resume == "auto":
        if (root / checkpoint.TRACKER_FILE).exists():
            return []
        return [
            Problem(
                f"{root} holds checkpoints (steps {steps[0]}..{steps[-1]}) but no "
                f"{checkpoint.TRACKER_FILE}, so trainer.resume=auto would start afresh over them. Resume "
                f"with trainer.resume={root} (the newest complete one), or start over with "
                "trainer.overwrite=true",
                missing=False,
            )
        ]
    return [
        Problem(
            f"{root} holds another run's checkpoints (steps {steps[0]}..{steps[-1]}) and "
            "trainer.resume=never would overwrite them. Use another output_dir, resume with "
            "trainer.resume=auto, or replace them with trainer.overwrite=true",
            missing=False,
        )
    ]
