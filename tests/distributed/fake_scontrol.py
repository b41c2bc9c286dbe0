"""`scontrol` as slurm/job.sh uses it, for the simulated cluster of tests/distributed/test_slurm_launch.py.

scontrol show hostnames NODELIST  the allocation's hosts: FAKE_SLURM_HOSTS (comma-separated), else 127.0.0.1
                                  once per node (SLURM_NNODES)
scontrol show job -o JOBID        one line with the job's JobState and Reason, read from
                                  $FAKE_SLURM_LOG/job_state ("STATE REASON", which fake_srun.end_job writes
                                  when Slurm ends the job; "RUNNING None" while it runs)
scontrol requeue JOBID            appends JOBID to $FAKE_SLURM_LOG/requeued. A running job is then ended as
                                  slurmctld does on a requeue: every process of the job gets SIGCONT and
                                  SIGTERM (bash runs a trap only once this command has returned, as it does
                                  when the signal follows Slurm's answer). A job Slurm is already ending is
                                  only marked for the restart.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from fake_srun import job_processes, send


def job_state(log: Path) -> tuple[str, str]:
    state = log / "job_state"
    text = state.read_text().split() if state.exists() else []
    return (text[0], text[1]) if text else ("RUNNING", "None")


def main(argv: list[str]) -> int:
    log = Path(os.environ["FAKE_SLURM_LOG"])
    match argv:
        case ["show", "hostnames", _]:
            hosts = os.environ.get("FAKE_SLURM_HOSTS")
            print("\n".join(hosts.split(",") if hosts else ["127.0.0.1"] * int(os.environ["SLURM_NNODES"])))
        case ["show", "job", "-o", job_id]:
            state, reason = job_state(log)
            name = os.environ.get("SLURM_JOB_NAME", "?")
            print(
                f"JobId={job_id} JobName={name} JobState={state} Reason={reason} Dependency=(null) Requeue=1"
            )
        case ["requeue", job_id]:
            with open(log / "requeued", "a") as requeued:
                requeued.write(f"{job_id}\n")
            if job_state(log)[0] == "RUNNING":
                (log / "job_state").write_text("COMPLETING None\n")
                others = [pid for pid in job_processes(job_id) if pid != os.getpid()]
                send(others, signal.SIGCONT)
                send(others, signal.SIGTERM)
        case _:
            print(f"fake scontrol: unexpected arguments {argv}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
