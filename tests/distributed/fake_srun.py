"""`srun` as slurm/job.sh uses it, for simulated nodes on one machine: `python fake_srun.py [OPTIONS] CMD...`.

Runs CMD once per node (SLURM_NNODES, each with its SLURM_NODEID) and does what Slurm does (srun: Slurm's
src/srun/signals.c and launch.c; slurmstepd: src/slurmd/slurmstepd/req.c and mgr.c):
- a signal srun receives reaches every process of the step on every node, as slurmstepd delivers it through
  the step's cgroup: the whole process tree, not only each node's first process. Except SIGTERM, SIGHUP and
  SIGQUIT: srun answers those with SIGKILL to the whole step ("forcing job termination");
- `--kill-on-bad-exit=1`: when a node's task fails, every process of the step gets SIGCONT and SIGTERM, then
  SIGKILL KillWait seconds later (KILL_WAIT_S);
- when a node's task exits, slurmstepd SIGKILLs whatever the task left running in the step on that node; this
  fake says so on stderr ("left behind"), so a test can tell a launcher that waited for its children;
- `--container-image` (pyxis): the step runs with no Slurm client on PATH (the image has none: every PATH
  entry holding scontrol, srun or sbatch is dropped), sees only the paths of `--container-mounts` (refused
  with one line: a `--container-workdir`, an absolute path in the command, or PYTHON, HF_HOME, DAPO_SLURM_ENV
  outside them) and, with `--no-container-mount-home`, a HOME that does not exist;
- `-l`/`--label`: each output line is prefixed with its task number ("1: ...");
- the exit status is the highest of the nodes' (128 + signal for a node killed by one).

A process belongs to a step by a mark in its environment, which every descendant inherits, so processes that
start their own session or are re-parented still belong to it: `FAKE_SLURM_STEP=<job id>.<step>.<node>`. A
test marks the batch shell `<job id>.batch.0`; each srun marks its step `<job id>.<srun pid>.<node>`.
`job_processes` finds them; `signal_steps` and `end_job` do what slurmd does to a job's steps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

STEP_MARK = "FAKE_SLURM_STEP"
BATCH = "batch"
# slurm.conf's KillWait: 30 s by default, and slurmd waits at least 5; a short one keeps the tests short.
KILL_WAIT_S = 10.0
SLURM_CLIENT = ("scontrol", "srun", "sbatch")
# A HOME that exists nowhere: pyxis with --no-container-mount-home leaves HOME pointing at a directory the
# container does not have.
ABSENT_HOME = "/nonexistent/home-not-mounted"
# Variables whose absolute path the step opens (slurm/env.sh, slurm/launch.sh): inside the container they
# must be mounted.
PATH_VARIABLES = ("PYTHON", "HF_HOME", "DAPO_SLURM_ENV")
SRUN_KILLS_ON = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
SRUN_FORWARDS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


def job_processes(job_id: str, step: str | None = None, node: int | None = None) -> list[int]:
    """Pids of the live processes of job `job_id` (of one `step`, "batch" or an srun's; of one `node`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        for item in environ.split(b"\0"):
            name, _, value = item.decode(errors="replace").partition("=")
            if name != STEP_MARK:
                continue
            mark = value.split(".")
            if (
                len(mark) == 3
                and mark[0] == job_id
                and step in (None, mark[1])
                and (node is None or str(node) == mark[2])
            ):
                found.append(int(entry.name))
    return found


def send(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def wait_gone(find: Callable[[], list[int]], seconds: float) -> list[int]:
    """Wait up to `seconds` for the processes `find` lists to exit; returns those still alive."""
    deadline = time.monotonic() + seconds
    while (alive := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def signal_steps(job_id: str, signum: int) -> None:
    """slurmd delivering a signal to every process of the job's steps, not its batch step (`scancel
    --signal=SIG JOBID`)."""
    send([pid for pid in job_processes(job_id) if pid not in job_processes(job_id, BATCH)], signum)


def end_job(job_id: str, state_dir: Path, reason: str) -> None:
    """What Slurm does when it ends a running job: slurmctld records the state (`scontrol show job` then says
    JobState=COMPLETING, Reason=TimeLimit at the time limit, Reason=None for `scancel`), then slurmd sends
    SIGCONT and SIGTERM to every process of the job, batch step included (at the time limit the other steps
    get an earlier SIGTERM of their own), and SIGKILL to whatever is left KillWait seconds later. Returns once
    nothing of the job is left."""
    (state_dir / "job_state").write_text(f"COMPLETING {reason}\n")
    steps = [pid for pid in job_processes(job_id) if pid not in job_processes(job_id, BATCH)]
    if reason == "TimeLimit":
        send(steps, signal.SIGTERM)
    every = job_processes(job_id)
    send(every, signal.SIGCONT)
    send(every, signal.SIGTERM)
    send(wait_gone(lambda: job_processes(job_id), KILL_WAIT_S), signal.SIGKILL)
    wait_gone(lambda: job_processes(job_id), 10)


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0].startswith("-"):
        name, _, value = rest.pop(0).lstrip("-").partition("=")
        options[name] = value
    if not rest:
        sys.exit("fake srun: no command")
    return options, rest


def mounts(spec: str) -> list[str]:
    """The container paths of pyxis' `--container-mounts=SRC:DST[:FLAGS][,...]`. This fake cannot move a
    path, so it mounts only at the same path."""
    targets = []
    for entry in filter(None, spec.split(",")):
        source, _, rest = entry.partition(":")
        target = rest.partition(":")[0] or source
        if source != target:
            sys.exit(f"fake srun: cannot mount {source} at another path ({target}); mount it at {source}")
        targets.append(os.path.normpath(target))
    return targets


def visible(path: str, targets: list[str]) -> bool:
    path = os.path.normpath(path)
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets)


def container_environment(options: dict[str, str], command: list[str], env: dict[str, str]) -> dict[str, str]:
    """The step's environment inside the container (pyxis passes the caller's), or exit with one line when the
    step names a path the container does not have."""
    targets = mounts(options.get("container-mounts", ""))
    workdir = options.get("container-workdir")
    if workdir and not visible(workdir, targets):
        sys.exit(
            f"fake srun: --container-workdir={workdir} is not under --container-mounts "
            f"({options.get('container-mounts', '')}): it does not exist inside the container"
        )
    named = [(f"argument {arg!r}", arg.partition("=")[2] if "=" in arg else arg) for arg in command]
    named += [(f"{name}={env[name]}", env[name]) for name in PATH_VARIABLES if name in env]
    for what, path in named:
        if path.startswith("/") and not visible(path, targets):
            sys.exit(
                f"fake srun: {what} names {path}, which is not under --container-mounts "
                f"({options.get('container-mounts', '')}): it does not exist inside the container"
            )
    path = [
        entry
        for entry in env.get("PATH", "").split(os.pathsep)
        if entry and not any(os.access(os.path.join(entry, tool), os.X_OK) for tool in SLURM_CLIENT)
    ]
    env = dict(env, PATH=os.pathsep.join(path))
    if "no-container-mount-home" in options:
        env["HOME"] = ABSENT_HOME
    return env


def relay(source: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    for line in source:
        with lock:
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()


def say(text: str) -> None:
    print(f"fake srun: {text}", file=sys.stderr, flush=True)


def main() -> int:
    options, command = parse(sys.argv[1:])
    label = "l" in options or "label" in options
    kill_on_bad_exit = options.get("kill-on-bad-exit") == "1"
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    # Unique per srun call within the job (the job's steps 0, 1, ...): the pid of this srun will do.
    step = str(os.getpid())
    base = dict(os.environ)
    workdir = None
    if "container-image" in options:
        base = container_environment(options, command, base)
        workdir = options.get("container-workdir")

    def step_processes() -> list[int]:
        return job_processes(job_id, step)

    def forward(signum: int, frame: object) -> None:
        if signum in SRUN_KILLS_ON:
            say("forcing job termination")
            send(step_processes(), signal.SIGKILL)
        else:
            send(step_processes(), signum)

    for signum in (*SRUN_KILLS_ON, *SRUN_FORWARDS):
        signal.signal(signum, forward)

    terminating = threading.Event()

    def terminate_step() -> None:  # slurmstepd's SIG_TERM_KILL
        send(step_processes(), signal.SIGCONT)
        send(step_processes(), signal.SIGTERM)
        left = wait_gone(step_processes, KILL_WAIT_S)
        if left:
            say(f"KillWait over: SIGKILL to {len(left)} processes of the step")
            send(left, signal.SIGKILL)

    lock = threading.Lock()
    nodes, relays = [], []
    for node in range(int(os.environ["SLURM_NNODES"])):
        env = dict(
            base,
            SLURM_NODEID=str(node),
            SLURM_PROCID=str(node),
            SLURM_STEPID="0",
            **{STEP_MARK: f"{job_id}.{step}.{node}"},
        )
        process = subprocess.Popen(
            command, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        nodes.append(process)
        prefix = f"{node}: ".encode() if label else b""
        relays.append(threading.Thread(target=relay, args=(process.stdout, prefix, lock), daemon=True))
        relays[-1].start()
    pending = set(range(len(nodes)))
    statuses = [0] * len(nodes)
    while pending:
        for node in sorted(pending):
            try:
                statuses[node] = nodes[node].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            pending.discard(node)
            # Not yet gone is not left behind: a process killed a moment ago may still be listed.
            left = wait_gone(lambda node=node: job_processes(job_id, step, node), 0.5)
            if left:
                say(f"node {node}: its task exited and left behind {len(left)} processes: SIGKILL")
                send(left, signal.SIGKILL)
            if statuses[node] != 0 and kill_on_bad_exit and not terminating.is_set():
                terminating.set()
                threading.Thread(target=terminate_step, daemon=True).start()
    for thread in relays:
        thread.join(timeout=5)
    return max((s if s >= 0 else 128 - s) for s in statuses)


if __name__ == "__main__":
    sys.exit(main())
