"""`srun` as slurm/job.sh uses it, for simulated nodes on one machine: `python fake_srun.py [OPTIONS] CMD...`.

Runs CMD once per node (SLURM_NNODES, each with its SLURM_NODEID) and, like Slurm:
- a signal srun receives (SIGUSR1, SIGTERM, SIGINT) goes to every process of the step, as slurmd delivers
  it through the step's cgroup: the whole process tree of every node, not only each node's first process.
  Membership is the step's mark in the environment, which every descendant inherits, so processes that
  start their own session or are re-parented still belong to the step;
- `--kill-on-bad-exit=1`: a node that fails kills the rest of the step;
- `-l`/`--label`: each output line is prefixed with its task number ("1: ...");
- the exit status is the highest of the nodes'.
The step's mark is `FAKE_SLURM_STEP=<SLURM_JOB_ID>.<counter>`; `step_processes` finds its processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

STEP_MARK = "FAKE_SLURM_STEP"


def step_processes(mark_prefix: str) -> list[int]:
    """Pids of the live processes whose environment holds `FAKE_SLURM_STEP=<mark_prefix>...`."""
    needle = f"{STEP_MARK}={mark_prefix}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if any(item.startswith(needle) for item in environ.split(b"\0")):
            found.append(int(entry.name))
    return found


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0].startswith("-"):
        name, _, value = rest.pop(0).lstrip("-").partition("=")
        options[name] = value
    if not rest:
        sys.exit("fake srun: no command")
    return options, rest


def relay(source: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    for line in source:
        with lock:
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()


def main() -> int:
    options, command = parse(sys.argv[1:])
    label = "l" in options or "label" in options
    kill_on_bad_exit = options.get("kill-on-bad-exit") == "1"
    job_id = os.environ.get("SLURM_JOB_ID", "0")
    # Unique per srun call within the job (the job's steps 0, 1, ...): the pid of this srun will do.
    mark = f"{job_id}.{os.getpid()}"

    def deliver(signum: int, frame: object) -> None:
        for pid in step_processes(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, deliver)

    lock = threading.Lock()
    nodes, relays = [], []
    for node in range(int(os.environ["SLURM_NNODES"])):
        env = dict(
            os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_STEPID="0", **{STEP_MARK: mark}
        )
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        nodes.append(process)
        prefix = f"{node}: ".encode() if label else b""
        relays.append(threading.Thread(target=relay, args=(process.stdout, prefix, lock), daemon=True))
        relays[-1].start()
    pending = set(range(len(nodes)))
    statuses = [0] * len(nodes)
    while pending:
        for index in list(pending):
            try:
                statuses[index] = nodes[index].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            pending.discard(index)
            if statuses[index] != 0 and kill_on_bad_exit:
                deliver(signal.SIGKILL, None)
    for thread in relays:
        thread.join(timeout=5)
    return max((s if s >= 0 else 128 - s) for s in statuses)


if __name__ == "__main__":
    sys.exit(main())
