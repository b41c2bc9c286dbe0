"""A temporary folder of the trainer's own, for everything it and its children put in TMPDIR
(multiprocessing's `pymp-*` folders, wandb's staging folders, the engine's sockets): removed when the trainer
exits, and by the engine's guard (`rollout/engine_guard.py`) should the trainer be killed."""

from __future__ import annotations

import atexit
import contextlib
import getpass
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUN_TMPDIR_ENV = "DAPO_RUN_TMPDIR"


SHM_MANAGER_GRACE_S = 10.0
"""How long the folder waits, after the trainer is gone, for torch's shared-memory manager to leave it."""

MAX_BASE_CHARS = 48
"""Sockets live two levels below the folder (multiprocessing's `pymp-*/listener-*`, the engine's
`dapo-engine-*/tmp*`), and AF_UNIX paths are limited to 107 bytes: under a longer TMPDIR the run keeps it."""


def use_run_tmpdir() -> Path | None:
    """Point this process's and its future children's TMPDIR at a new folder under the current one; once per
    process (a second call returns the same folder). None, changing nothing, under a TMPDIR too long."""
    existing = os.environ.get(RUN_TMPDIR_ENV)
    if existing and tempfile.gettempdir() == existing:  # made by this process
        return Path(existing)
    base = tempfile.gettempdir()
    if len(base) > MAX_BASE_CHARS:
        return None
    path = Path(tempfile.mkdtemp(prefix="dapo-", dir=base))
    # torch's compile cache is meant to outlive the process: keep it where it would have been.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, f"torchinductor_{_user()}"))
    os.environ["TMPDIR"] = os.environ[RUN_TMPDIR_ENV] = str(path)
    tempfile.tempdir = str(path)
    atexit.register(_remove_if_made_here, path, os.getpid())
    return path


def _remove_if_made_here(path: Path, pid: int) -> None:
    # Forked children (megatron-core's checkpoint writers, the reward pool) inherit this exit handler; the
    # folder is the trainer's to remove, and still in use when they exit. Not removed from here: libtorch
    # still uses files in it while the interpreter shuts down, and torch's shared-memory manager keeps its
    # socket in a `torch-shm-dir-*` folder there until it notices, a second or two after this process is
    # gone, that its last client left (either one, finding its files removed, aborts with "terminate called
    # after throwing an instance of 'std::system_error'"). So a detached process removes the folder once
    # this one is gone and the manager has removed its own folder (or SHM_MANAGER_GRACE_S has passed).
    if os.getpid() != pid:
        return
    remover = (
        "import glob, os, shutil, sys, time\n"
        "pid, path, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])\n"
        "def running():\n"
        "    try:\n"
        "        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'\n"
        "    except OSError:\n"
        "        return False\n"
        "while running():\n"
        "    time.sleep(0.05)\n"
        "deadline = time.monotonic() + grace\n"
        "while glob.glob(os.path.join(path, 'torch-shm-dir-*')) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "shutil.rmtree(path, ignore_errors=True)\n"
    )
    with contextlib.suppress(OSError):
        subprocess.Popen(
            [sys.executable, "-S", "-c", remover, str(pid), str(path), str(SHM_MANAGER_GRACE_S)],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
        )


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        return str(os.getuid())
