"""A SIGKILLed trainer leaves nothing it started: the engine's guard (`rollout/engine_guard.py`) stops the
processes the trainer started in its session (here a multiprocessing manager, as megatron-core's checkpoint
writer starts one, and torch's shared-memory manager), the trainer's torch shared-memory segments, and the
trainer's temporary folder (`distributed/run_tmpdir.py`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

TRAINER = """
import multiprocessing, os, subprocess, sys, time
os.environ["PYTHONUNBUFFERED"] = "1"  # the server's start line reaches the guard's log at once
import torch
from dapo_megatron.distributed.run_tmpdir import use_run_tmpdir

run = use_run_tmpdir()
torch.multiprocessing.set_sharing_strategy("file_system")  # as the trainer shares weights with its engine
shared = torch.zeros(1024).share_memory_()  # a /dev/shm/torch_<pid>_* segment and torch_shm_manager
manager = multiprocessing.get_context("fork").Manager()
queue = manager.Queue()
(run / "pymp-like").mkdir()
(run / "engine").mkdir()
guard = subprocess.Popen(
    [sys.executable, "-m", "dapo_megatron.rollout.engine_guard", "--parent", str(os.getpid()),
     "--log", sys.argv[1], "--tmpdir", str(run / "engine"), "--", "http.server", "0", "--bind", "127.0.0.1"],
    start_new_session=True,
)
print(manager._process.pid, guard.pid, run, flush=True)
sys.stdin.readline()
late = os.fork()  # as a checkpoint writer forked just before the kill, after the guard's last look
if late == 0:
    time.sleep(600)
    os._exit(0)
print(late, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _torch_segments(pid: int) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"torch_{pid}_*"))


def test_a_killed_trainer_leaves_no_process_and_no_temporary_file(tmp_path: Path) -> None:
    # Short, as a TMPDIR must be for multiprocessing's sockets (`run_tmpdir.MAX_BASE_CHARS`).
    tmpdir, log = Path(tempfile.mkdtemp(prefix="reap-")), tmp_path / "engine.log"
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(REPO))
    env.pop("DAPO_RUN_TMPDIR", None)
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(log)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        manager, guard, run = trainer.stdout.readline().split()
        assert Path(run).parent == tmpdir
        deadline = time.monotonic() + 60
        while "Serving HTTP" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)  # the guard has seen the trainer's processes (it looks every 2 s)
        trainer.stdin.write("fork\n")
        trainer.stdin.flush()
        late = int(trainer.stdout.readline())
        segments = _torch_segments(trainer.pid)
        assert segments, "torch's file_system sharing made no /dev/shm/torch_<pid>_* segment"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 30
        while any(map(_alive, (int(manager), int(guard), late))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(int(manager)), "the trainer's multiprocessing manager outlived it"
        assert not _alive(late), "a child the trainer forked just before its death outlived it"
        assert not _alive(int(guard))
        assert list(tmpdir.iterdir()) == [], "the trainer's temporary folder outlived it"
        assert _torch_segments(trainer.pid) == [], "the trainer's torch shared-memory segments outlived it"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        shutil.rmtree(tmpdir, ignore_errors=True)
        for segment in _torch_segments(trainer.pid):
            segment.unlink(missing_ok=True)


def test_a_tmpdir_too_long_for_sockets_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dapo_megatron.distributed import run_tmpdir

    long_base = tmp_path / ("x" * run_tmpdir.MAX_BASE_CHARS)
    long_base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_base))
    monkeypatch.delenv(run_tmpdir.RUN_TMPDIR_ENV, raising=False)
    assert run_tmpdir.use_run_tmpdir() is None
    assert tempfile.gettempdir() == str(long_base) and run_tmpdir.RUN_TMPDIR_ENV not in os.environ


@contextlib.contextmanager
def _run_in_fresh_tmpdir(script: str) -> Iterator[subprocess.CompletedProcess[str]]:
    """`script` as a trainer process under a TMPDIR of its own, its output captured once every process that
    inherited its pipes has exited; the TMPDIR is removed after the caller's checks."""
    base = Path(tempfile.mkdtemp(prefix="run-"))
    try:
        env = dict(os.environ, TMPDIR=str(base), PYTHONPATH=str(REPO))
        env.pop("DAPO_RUN_TMPDIR", None)
        yield subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _gone(path: Path, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


def test_a_forked_child_leaving_does_not_remove_the_trainers_folder() -> None:
    script = (
        "import os, sys\n"
        "from dapo_megatron.distributed.run_tmpdir import use_run_tmpdir\n"
        "run = use_run_tmpdir()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)  # exit handlers run, as in a forked worker that returns normally\n"
        "os.waitpid(pid, 0)\n"
        "print(run, run.is_dir())\n"
    )
    with _run_in_fresh_tmpdir(script) as out:
        run, still_there = out.stdout.split()
        assert still_there == "True", out.stderr
        assert _gone(Path(run)), "the trainer's own exit removes its folder"


def test_a_trainer_that_shared_tensors_exits_quietly_and_leaves_no_folder() -> None:
    """torch's shared-memory manager keeps its socket in the run's folder until after the trainer is gone:
    removed under it, the manager aborts with a C++ `std::system_error` on the trainer's console."""
    script = (
        "import torch\n"
        "from dapo_megatron.distributed.run_tmpdir import use_run_tmpdir\n"
        "run = use_run_tmpdir()\n"
        "torch.multiprocessing.set_sharing_strategy('file_system')\n"
        "shared = torch.zeros(16).share_memory_()  # starts torch_shm_manager, its socket in the folder\n"
        "print(run, flush=True)\n"
    )
    # The manager inherits the pipes: this returns once it has exited too, with what it printed.
    with _run_in_fresh_tmpdir(script) as out:
        assert out.returncode == 0, out.stderr
        assert "terminate called" not in out.stderr, out.stderr
        assert _gone(Path(out.stdout.strip())), "the trainer's folder outlived it"
