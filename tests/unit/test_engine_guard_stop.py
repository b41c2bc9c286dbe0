"""How the engine's guard (`rollout/engine_guard.py`) stops its server when the trainer asks: a GPU engine
gets SIGTERM and its graceful shutdown, a CPU engine (`--stop-by-kill`) is SIGKILLed at once; and what it
removes from /dev/shm afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import REPO

SERVER = """
import pathlib, signal, sys, time

def on_sigterm(signum, frame):
    pathlib.Path(sys.argv[1]).write_text("graceful shutdown")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_sigterm)
print("serving", flush=True)
time.sleep(600)
"""


def start_guard(tmp_path: Path, flags: Sequence[str], *server_args: str) -> subprocess.Popen[bytes]:
    """The guard over `fake_server.py` (already in `tmp_path`), once the server says it serves."""
    log, server_tmp = tmp_path / "server.log", tmp_path / "server_tmp"
    server_tmp.mkdir()
    guard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dapo_megatron.rollout.engine_guard",
            "--parent",
            str(os.getpid()),
            "--log",
            str(log),
            "--tmpdir",
            str(server_tmp),
            *flags,
            "--",
            "fake_server",
            *server_args,
        ],
        env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"),
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not (log.exists() and "serving" in log.read_text()):
        if guard.poll() is not None or time.monotonic() > deadline:
            stop(guard)
            pytest.fail(f"the server did not start: {log.read_text() if log.exists() else ''}")
        time.sleep(0.05)
    return guard


def stop(guard: subprocess.Popen[bytes]) -> int:
    """As the trainer's SGLangEngine.shutdown does; SIGKILLs the session if the guard does not exit."""
    guard.send_signal(signal.SIGTERM)
    try:
        return guard.wait(timeout=30)
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)
            guard.wait()


@pytest.mark.parametrize(("flags", "graceful"), [([], True), (["--stop-by-kill"], False)])
def test_the_guard_stops_its_server_gracefully_or_by_kill(
    tmp_path: Path, flags: list[str], graceful: bool
) -> None:
    (tmp_path / "fake_server.py").write_text(SERVER)
    mark = tmp_path / "mark"
    assert stop(start_guard(tmp_path, flags, str(mark))) == 0
    assert mark.exists() == graceful
    assert not (tmp_path / "server_tmp").exists()  # the server's TMPDIR goes with it either way


LEAVES_A_SLOT_FILE = """
import pathlib, sys, time

pathlib.Path(sys.argv[1]).write_bytes(bytes(16))  # made and closed at once: no scan sees it held
print("serving", flush=True)
time.sleep(600)
"""


def test_the_guard_removes_slot_files_nobody_holds_that_changed_while_it_ran(tmp_path: Path) -> None:
    """SGLang's `sglang_loads_*` slot files have random names; the guard removes those it saw its server hold,
    and those no process holds that changed while it ran (the file of a server killed before a scan saw it).
    It keeps one a living process holds and one that is older than the guard."""
    (tmp_path / "fake_server.py").write_text(LEAVES_A_SLOT_FILE)
    shm, tag = Path("/dev/shm"), uuid.uuid4().hex[:12]
    older, left, held = (shm / f"sglang_loads_{tag}_{kind}.shm" for kind in ("older", "left", "held"))
    try:
        older.write_bytes(bytes(16))
        time.sleep(0.1)  # its change time before the guard's start
        guard = start_guard(tmp_path, ["--stop-by-kill"], str(left))
        with held.open("wb") as holder:
            holder.write(bytes(16))
            holder.flush()
            assert left.exists() and stop(guard) == 0
            assert not left.exists(), "a slot file nobody holds, made while the guard ran, was left"
            assert held.exists() and older.exists()
    finally:
        for path in (older, left, held):
            path.unlink(missing_ok=True)
