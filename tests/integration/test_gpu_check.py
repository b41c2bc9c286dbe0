"""tools/gpu_check.py: every stage a CPU can run, for real (megatron-core on gloo, a real SGLang engine), and
the bookkeeping that keeps one failed stage from hiding the others. The CUDA-only measurements (MFU, GPU
memory, FP8) are what is left for a GPU; the README's GPU table says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, free_port, load_script

gpu_check = load_script(REPO / "tools" / "gpu_check.py")


def run_check(tmp_path: Path, *args: str, launcher: tuple[str, ...] = ()) -> dict[str, str]:
    """tools/gpu_check.py on the CPU at a tiny size (under `launcher`, e.g. torchrun): each stage's line by
    name; the run must pass."""
    proc = subprocess.run(
        [
            sys.executable,
            *launcher,
            "tools/gpu_check.py",
            "--allow-cpu",
            "--steps",
            "1",
            "--batch-size",
            "4",
            "--micro-batch-size",
            "2",
            "--seq-length",
            "32",
            "--logprob-tokens",
            "256",
            "--workdir",
            str(tmp_path),
            *args,
            "model=tiny",
            "rollout.startup_timeout_s=300",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        line.split(":")[0].split()[-1]: line
        for line in proc.stdout.splitlines()
        if line.startswith("gpu_check ")
    }


@pytest.mark.sglang
def test_cpu_run_passes_every_stage_it_can(tmp_path: Path) -> None:
    lines = run_check(tmp_path)
    assert "ok" in lines["environment"] and "megatron-core 0.16.1" in lines["environment"]
    assert "CPU compatibility layer on" in lines["environment"]
    assert "ok" in lines["fp32"] and "ms/step" in lines["fp32"]
    assert "ok" in lines["log-probs"] and "max |diff|" in lines["log-probs"]
    assert "skipped: model.fp8.enabled=true needs a CUDA GPU" in lines["fp8"]
    assert "skipped: needs data parallelism" in lines["param-gather"]  # one process: see the next test
    assert "ok" in lines["checkpoint"] and "next step has the same loss" in lines["checkpoint"]
    assert "slurm/env.sh set" in lines["environment"] and "NCCL_IB_TIMEOUT" in lines["environment"]
    # The engine got the weights after a training step: its log-probs agree with the trainer's (fp32).
    assert "ok" in lines["engine"] and "probe log-probs within" in lines["engine"], lines["engine"]
    gap = float(lines["engine"].split("probe log-probs within ")[1].split()[0])
    assert gap <= 1e-3
    assert not list(tmp_path.iterdir()), "the check left files behind"


def test_data_parallel_stages_under_torchrun(tmp_path: Path) -> None:
    """Two data-parallel ranks: the deferred parameter all-gather (the recipes' overlap_param_gather) leaves
    the weights a reader sees equal to the synchronous step's, and a checkpoint resumes to the same step."""
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()))
    lines = run_check(tmp_path, "--stages", "param-gather,checkpoint", launcher=torchrun)
    assert sorted(lines) == ["checkpoint", "param-gather"]
    assert all(": ok (" in line for line in lines.values()), lines
    gather = lines["param-gather"]
    assert "weights within 0 of the synchronous step's" in gather, gather
    assert float(gather.split("(up to ")[1].split()[0]) > 1e-3  # the case shows a deferred update


def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert "no CUDA GPU is visible" in proc.stderr and "--allow-cpu" in proc.stderr


class _Layout:
    is_logging_rank = True
    device = torch.device("cpu")


def test_a_failed_stage_is_reported_and_the_next_ones_still_run(capsys: pytest.CaptureFixture[str]) -> None:
    def broken(check: object) -> str:
        raise ValueError("boom")

    def unavailable(check: object) -> str:
        raise gpu_check.Skip("no such thing here")

    check = gpu_check.Check(job=None, layout=_Layout(), args=None, workdir=Path("."))  # type: ignore[arg-type]
    results = gpu_check.run_stages(check, {"first": broken, "second": unavailable, "third": lambda c: "fine"})
    assert results["first"] == "FAILED: ValueError: boom"
    assert results["second"] == "skipped: no such thing here"
    assert results["third"].startswith("ok (") and results["third"].endswith("fine")
    printed = capsys.readouterr().out
    assert "gpu_check       first: FAILED: ValueError: boom" in printed
