"""How the engine's guard (`rollout/engine_guard.py`) stops its server when the trainer asks: a GPU engine
gets SIGTERM and its graceful shutdown, a CPU engine (`--stop-by-kill`) is SIGKILLed at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


@pytest.mark.parametrize(("flags", "graceful"), [([], True), (["--stop-by-kill"], False)])
def test_the_guard_stops_its_server_gracefully_or_by_kill(
    tmp_path: Path, flags: list[str], graceful: bool
) -> None:
    (tmp_path / "fake_server.py").write_text(SERVER)
    mark, log, server_tmp = tmp_path / "mark", tmp_path / "server.log", tmp_path / "server_tmp"
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
            str(mark),
        ],
        env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and "serving" in log.read_text()):
            assert guard.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        guard.send_signal(signal.SIGTERM)  # the trainer's SGLangEngine.shutdown
        assert guard.wait(timeout=30) == 0
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)
            guard.wait()
    assert mark.exists() == graceful
    assert not server_tmp.exists()  # the server's TMPDIR goes with it either way
