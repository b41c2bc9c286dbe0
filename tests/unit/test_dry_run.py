"""`python -m dapo_megatron.train experiment=... dry_run=true`: validates every recipe for the GPUs it was
planned for and prints each rank's place, without GPUs, process groups or weights."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from dapo_megatron import config as C
from dapo_megatron.planning.checkpoint import plan_checkpoint
from dapo_megatron.planning.memory import plan_memory
from dapo_megatron.planning.stop import plan_stop_lead
from dapo_megatron.train import main as train_main
from tests.conftest import REPO

RECIPES = ["dapo_qwen2.5_32b", "dapo_qwen2.5_7b", "dapo_qwen2.5_0.5b"]


def dry_run(*overrides: str) -> subprocess.CompletedProcess:
    # No torchrun variables and no CUDA: the dry run must not need either.
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "dapo_megatron.train", *overrides, "dry_run=true"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_rank_table(recipe: str, stdout: str) -> None:
    job = C.to_job_config(C.compose([f"experiment={recipe}"]))
    ranks = re.findall(
        r"^rank +(\d+) \| node +(\d+) gpu (\d+) \| tp (\d+) pp (\d+) dp +(\d+) \| layers (\d+)-(\d+)",
        stdout,
        flags=re.MULTILINE,
    )
    assert [int(r[0]) for r in ranks] == list(range(job.cluster.world_size))
    par = job.parallel
    dp = job.cluster.world_size // par.model_parallel_size
    coordinates = {tuple(map(int, r[3:6])) for r in ranks}
    assert len(coordinates) == job.cluster.world_size  # every (tp, pp, dp) exactly once
    assert {c[0] for c in coordinates} == set(range(par.tensor_model_parallel_size))
    assert {c[2] for c in coordinates} == set(range(dp))
    assert int(ranks[-1][7]) == job.model.num_layers - 1
    assert re.search(r"^fits: peak [\d.]+ GiB of 80 GiB", stdout, flags=re.MULTILINE)


def test_32b_dry_run_in_a_fresh_process() -> None:
    result = dry_run("experiment=dapo_qwen2.5_32b")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    check_rank_table("dapo_qwen2.5_32b", result.stdout)
    check_checkpoint_and_stop_lead(result.stdout)


def check_checkpoint_and_stop_lead(stdout: str) -> None:
    """The 32B checkpoint (planning/checkpoint.py): its phase's GPU memory, its bytes in all and per rank,
    the host memory of a save and a load, their times; the stop signal's lead (planning/stop.py)."""
    assert re.search(r"^GiB per GPU .* checkpoint$", stdout, flags=re.MULTILINE)
    assert re.search(r"^total of 80( +[\d.]+){4}$", stdout, flags=re.MULTILINE)
    checkpoint = re.search(
        r"^checkpoint: 458\.7 GB \(weights 65\.5 \+ optimizer 393\.2\), each tensor written once, by every "
        r"rank: 3\.58 GB per rank, 28\.7 GB per node; host memory per rank 3\.34 GiB while saving .*, "
        r"0\.18 GiB while loading .*; save ~14 s at 2 GB/s per node, load ~7 s at 4 GB/s .*; a resume reads "
        r"458\.7 GB$",
        stdout,
        flags=re.MULTILINE,
    )
    assert checkpoint, stdout
    job = C.to_job_config(C.compose(["experiment=dapo_qwen2.5_32b"]))
    planned = math.ceil(plan_stop_lead(job, plan_memory(job), plan_checkpoint(job)).lead_s)
    assert f"\ntime-limit stop: the signal needs {planned} s before the limit (#SBATCH" in stdout
    assert re.search(r"engine workers' CUDA contexts \(IPC\) +1\.50 +1\.50 +1\.50 +1\.50$", stdout, re.M)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_dry_run_prints_every_rank_and_fits(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    # In this process, through the trainer's own entry point (the subprocess test above covers a cold start).
    assert train_main([f"experiment={recipe}", "dry_run=true"]) == 0
    check_rank_table(recipe, capsys.readouterr().out)
    assert not torch.distributed.is_initialized()


def test_impossible_layout_fails_naming_the_field() -> None:
    result = dry_run("experiment=dapo_qwen2.5_32b", "parallel.tensor_model_parallel_size=3")
    assert result.returncode == 2
    assert "parallel.tensor_model_parallel_size=3" in result.stderr
    assert "rank    0" not in result.stdout


def test_layout_that_does_not_fit_names_one_that_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        train_main(
            [
                "experiment=dapo_qwen2.5_32b",
                "parallel.use_distributed_optimizer=false",
                "parallel.overlap_param_gather=false",
                "dry_run=true",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert re.search(r"^does not fit: \w[\w ]* needs [\d.]+ GiB of 80 GiB", out, flags=re.MULTILINE)
    assert re.search(r"^nearest layout that fits .*: \S+=\S+", out, flags=re.MULTILINE)


def test_overlapped_rollouts_are_refused_for_colocated_gpu_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        train_main(
            [
                "experiment=dapo_qwen2.5_32b",
                "trainer.overlap_rollout=true",
                "trainer.offload_during_rollout=false",
                "algo.old_log_prob_source=rollout",
                "dry_run=true",
            ]
        )
        == 2
    )
    assert (
        "trainer.overlap_rollout=true generates while the policy trains, but a colocated GPU engine"
        in capsys.readouterr().err
    )
