"""No engine outlives its trainer: a trainer-like process starts a real SGLang engine through our rollout
code, gets SIGTERM or SIGINT during the engine's start-up, during generation or during a weight sync, or
SIGKILL, and afterwards no process of the engine is left, nor a /dev/shm file one of its processes held, nor a
temporary file.

The engine's processes are found by a marker in their environment, which every process the trainer starts
inherits (SGLang's workers rename themselves, so their command lines cannot be matched). The trainer's TMPDIR
is a folder of the test's own, so every temporary file of the run lands there. One engine at a time: each
case waits for the previous one's processes to be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.sglang

TRAINER = textwrap.dedent("""
    import faulthandler, signal, sys, time
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, should it not exit in time
    # As started from a terminal: a job started in the background by a non-interactive shell inherits SIGINT
    # ignored, and the engine's handlers rightly leave an ignored signal ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from pathlib import Path
    import torch
    from safetensors.torch import load_file
    from dapo_megatron.backends import cpu_weight_loader
    from dapo_megatron.rollout.client import RolloutClient
    from dapo_megatron.rollout.engine import SGLangEngine
    from dapo_megatron.backends.cpu_weight_loader import named_views
    from dapo_megatron.rollout.weight_sync import flatten_bucket, post_all, push_bucket
    from tests.integration.conftest import engine_config

    def idle(seconds):  # as a trainer waits: in short sleeps, between which Python runs signal handlers
        for _ in range(int(seconds * 10)):
            time.sleep(0.1)

    model_dir, log_file, phase = sys.argv[1:]
    cfg = engine_config(startup_timeout_s=600.0, request_timeout_s=600.0)
    engine = SGLangEngine(model_dir, cfg, log_file=log_file).launch()
    print("launched", flush=True)
    if phase == "startup":
        idle(600)
    engine.wait_until_ready()
    if phase == "generate":
        client = RolloutClient(engine.url, cfg)
        groups = client.stream_groups([(0, [5, 6, 7])], n=4, max_new_tokens=4000, ignore_eos=True)
        print("working", flush=True)
        list(groups)
    if phase == "sync":
        torch.multiprocessing.set_sharing_strategy("file_system")  # as the CPU weight sync does
        weights = load_file(next(Path(model_dir).glob("*.safetensors")))
        payload = named_views(flatten_bucket(list(weights.items())))
        print("working", flush=True)
        while True:
            post_all([engine.url], "/begin_weight_update", {}, timeout_s=600)
            push_bucket([engine.url], payload, version="v", engine_tp_size=1, timeout_s=600,
                        load_format=cpu_weight_loader.LOAD_FORMAT)
            post_all([engine.url], "/end_weight_update", {}, timeout_s=600)
    idle(600)
""")

MARKER_VARIABLE = "DAPO_TEST_ENGINE_CLEANUP"
SHM = Path("/dev/shm")


def marked_processes(marker: str) -> list[int]:
    """Living (not zombie) processes whose environment carries the marker."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry))
    return found


def shm_files_of(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes hold open or mapped, and torch's segments named after them."""
    names = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        paths = links + [line.split(maxsplit=5)[-1] for line in maps if len(line.split()) == 6]
        names |= {path.split("/dev/shm/", 1)[1] for path in paths if "/dev/shm/" in path}
    names |= {p.name for p in SHM.iterdir() if any(p.name.startswith(f"torch_{pid}_") for pid in pids)}
    return {name for name in names if not name.startswith("sem.")}  # semaphores: unlinked at creation


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture
def marker() -> Iterator[str]:
    marker = uuid.uuid4().hex
    yield marker
    for pid in marked_processes(marker):  # only when a case failed
        os.kill(pid, signal.SIGKILL)


CASES = [
    ("startup", signal.SIGTERM),
    ("startup", signal.SIGINT),
    ("generate", signal.SIGTERM),
    ("sync", signal.SIGTERM),
    ("generate", signal.SIGKILL),
]


@pytest.mark.parametrize(("phase", "signum"), CASES, ids=[f"{p}-{s.name}" for p, s in CASES])
def test_killed_trainer_leaves_no_engine_behind(
    tiny_model_dir: Path, tmp_path: Path, marker: str, phase: str, signum: signal.Signals
) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, MARKER_VARIABLE: marker, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO)}
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tiny_model_dir), str(tmp_path / "engine.log"), phase],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout.readline() == "launched\n"  # type: ignore[union-attr]
        if phase == "startup":
            # The server has begun making its temporary files (its sockets), before the model is loaded.
            assert wait_for(lambda: any(p.is_file() for p in tmpdir.rglob("*")), timeout=300)
        else:
            assert trainer.stdout.readline() == "working\n"  # type: ignore[union-attr]
            time.sleep(2.0)  # into the requests
        held = shm_files_of(marked_processes(marker))
        trainer.send_signal(signum)
        # Generous: stopping an engine mid-start on two loaded cores has taken over two minutes.
        try:
            code = trainer.wait(timeout=300)
        except subprocess.TimeoutExpired:
            trainer.send_signal(signal.SIGUSR1)  # its threads' stacks, on the captured stderr
            time.sleep(2.0)
            raise
        # The handler stops the engine first, then the signal takes its course (SIGINT: through a
        # KeyboardInterrupt, after which Python dies of SIGINT).
        assert code == -signum
        assert wait_for(lambda: not marked_processes(marker), timeout=60), (
            f"engine processes left: {marked_processes(marker)}"
        )
        assert wait_for(lambda: not [n for n in held if (SHM / n).exists()], timeout=30), (
            f"/dev/shm files left: {sorted(n for n in held if (SHM / n).exists())}"
        )
        assert list(tmpdir.iterdir()) == []
    finally:
        trainer.kill()
        trainer.wait()
