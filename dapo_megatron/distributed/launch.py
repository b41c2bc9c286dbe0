"""Where this process sits in the job: read from torchrun, Slurm's srun, or nothing (one process)."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
"""A job's rendezvous port is `RDZV_PORT_BASE + job_id % RDZV_PORT_SPAN` (slurm/launch.sh computes the same):
one per job, so jobs sharing a node do not collide, and all below Linux's ephemeral range (32768-60999 by
default, /proc/sys/net/ipv4/ip_local_port_range), where the kernel hands out ports to outgoing connections."""


@dataclass(frozen=True)
class ProcessEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """`torchrun`, `slurm` or `single`."""
    node: int = 0
    """Index of this process's node (torchrun's GROUP_RANK, Slurm's SLURM_NODEID): processes on one node
    share memory, and rollout weights travel between nodes differently."""


def first_host(nodelist: str) -> str:
    """The first hostname of a Slurm node list, without calling `scontrol`.

    >>> first_host("gpu-[012-015,020],login1")
    'gpu-012'
    """
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def process_env(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """torchrun's variables win over Slurm's (srun can launch torchrun); without either, one process.

    Under srun (one task per GPU) the rendezvous is the first node of the allocation and the port is
    derived from the job id (`rendezvous_port`).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return ProcessEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun",
            node=int(env.get("GROUP_RANK", 0)),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return ProcessEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT") or rendezvous_port(job_id)),
            launcher="slurm",
            node=int(env.get("SLURM_NODEID", 0)),
        )
    return ProcessEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=int(env.get("MASTER_PORT", 0)) or _free_port(),
        launcher="single",
    )


def rendezvous_port(job_id: int) -> int:
    return RDZV_PORT_BASE + job_id % RDZV_PORT_SPAN


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
