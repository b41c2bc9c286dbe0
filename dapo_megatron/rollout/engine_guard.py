"""The process the trainer starts for an SGLang server: it keeps the server from outliving the trainer, and
the server's API key out of command lines and logs.

    python -m dapo_megatron.rollout.engine_guard --parent PID --log FILE --tmpdir DIR [--stop-by-kill] \
        -- MODULE [ARGS...]

It leads a session of its own (the trainer starts it so) and runs `python -m MODULE ARGS` (SGLang's launcher,
or `backends/sglang_cpu.py`) in that session, with
* the API key: read from `API_KEY_ENV` and added as `--api-key` and `--admin-api-key` inside the server
  process (`--serve`), so that it shows in no command line (`ps` shows those to every user of the node).
  SGLang prints its arguments, key included, when it starts: the server's output reaches the log through
  this process, with the key replaced.
* `TMPDIR=DIR`: SGLang's sockets and other temporary files go there, and the folder goes with the server.

It stops the server, then whatever is left in its session, when the trainer asks (SIGTERM, SIGINT, SIGHUP,
unless ignored), when the trainer is gone (its parent pid changes; polled, because `PR_SET_PDEATHSIG` follows
the thread that started a process rather than the process), or when the server exits. SGLang's scheduler and
detokenizer die with their launcher (they set a parent-death signal); what still lives after the launcher's
grace period is SIGKILLed. With `--stop-by-kill` (CPU engines) there is no grace period: the whole session is
SIGKILLed at once. SGLang's graceful stop notices SIGTERM on a 5-second poll and took 5-8 s on CPU, where it
releases nothing that a kill would leave behind: what the server leaves in /dev/shm and TMPDIR is removed
below either way. Then it removes what the server's processes left in /dev/shm: the `sglang_loads_*` slot
files it saw them hold open, those that no process holds and that changed while it ran (a scan every 2 s
misses the file of a server killed right after making it; whoever left one, nothing can use it), and torch's
`torch_<pid>_*` segments of their pids (torch's shared-memory manager, which would remove those, dies in the
same session). The server process itself dies at once should the guard be killed (`_die_with`).

Should the trainer be killed (SIGKILL: no handler of its own runs), the guard also stops what the trainer
started in its own session and would otherwise outlive it (megatron-core's checkpoint-writer manager,
multiprocessing's resource tracker and fork server, the reward workers, torch's shared-memory manager),
removes the `torch_<pid>_*` segments of the trainer and of those processes, and removes the trainer's
temporary folder (`distributed/run_tmpdir.py`).

Import-light on purpose (no torch, no SGLang): it is one more process per engine for the whole job.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from dapo_megatron.distributed.run_tmpdir import RUN_TMPDIR_ENV

API_KEY_ENV = "DAPO_ENGINE_API_KEY"
REDACTED = "<redacted>"
GRACE_S = 10.0
"""How long SGLang's launcher gets to stop its workers after SIGTERM (it needs ~1 s)."""
_POLL_S = 0.5
_SCAN_EVERY_S = 2.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SHM = Path("/dev/shm")
_SLOT_FILES = "sglang_loads_"
_TORCH_SEGMENT = re.compile(r"torch_(\d+)_")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    session: int
    started: int
    """Start time in clock ticks since boot: with the pid, it names one process even after pids are reused."""


def living_processes() -> list[ProcStat]:
    """Every living (not zombie) process of this machine's pid namespace."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The fields after the command name, which may hold spaces and parentheses: state, ppid, pgrp,
        # session, ..., starttime (the 20th).
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            found.append(ProcStat(int(entry), int(fields[1]), int(fields[3]), int(fields[19])))
    return found


def session_members(session: int) -> list[int]:
    """Pids of the living processes of `session`."""
    return [proc.pid for proc in living_processes() if proc.session == session]


def descendants(root: int, session: int, table: list[ProcStat]) -> list[ProcStat]:
    """The processes below `root` in `table` that are in `session` (other sessions, such as other engines'
    guards, clean up after themselves)."""
    children: dict[int, list[ProcStat]] = {}
    for proc in table:
        children.setdefault(proc.ppid, []).append(proc)
    found, stack = [], [root]
    while stack:
        for proc in children.get(stack.pop(), []):
            if proc.session == session:
                found.append(proc)
                stack.append(proc.pid)
    return found


def slot_files_held(pid: int) -> set[str]:
    """Names of SGLang's /dev/shm slot files that process `pid` holds open or mapped."""
    paths = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    with contextlib.suppress(OSError):
        # address, perms, offset, dev, inode, then the path of a file mapping
        paths += [line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
    prefix = f"{_SHM}/{_SLOT_FILES}"
    return {path[len(str(_SHM)) + 1 :] for path in paths if path.startswith(prefix)}


def abandoned_slot_files(since: float) -> set[str]:
    """This user's SGLang slot files changed since `since` (`time.time()`) that no living process holds: those
    of an engine that died before a scan saw them held (their names are random, so nothing else ties them to
    it). One no process holds is garbage whoever made it; one changed before `since` is left to whoever did.
    Only this user's: another user's processes hide their open files (and /dev/shm lets only the owner remove
    a file anyway)."""
    held: set[str] = set()
    for proc in living_processes():
        held |= slot_files_held(proc.pid)
    found = set()
    for path in _SHM.glob(f"{_SLOT_FILES}*"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            if path.name not in held and stat.st_uid == os.getuid() and stat.st_ctime >= since:
                found.add(path.name)
    return found


def remove_slot_files(names: Iterable[str]) -> None:
    """Unlink these of SGLang's /dev/shm slot files, those that are still there."""
    for name in names:
        with contextlib.suppress(OSError):
            (_SHM / name).unlink(missing_ok=True)


def _still_alive(procs: Iterable[ProcStat]) -> list[ProcStat]:
    """Those of `procs` still running: the same pid and start time (their parent is init by now)."""
    alive = {(proc.pid, proc.started) for proc in living_processes()}
    return [proc for proc in procs if (proc.pid, proc.started) in alive]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Guard:
    def __init__(
        self, parent: int, log: Path, tmpdir: Path, server: list[str], *, stop_by_kill: bool = False
    ) -> None:
        self.parent, self.log, self.tmpdir, self.server = parent, log, tmpdir, server
        self.stop_by_kill = stop_by_kill
        self.started = time.time()
        self.key = os.environ.pop(API_KEY_ENV, None) or None
        self.stop = threading.Event()
        self.pids_seen: set[int] = set()
        self.slot_files: set[str] = set()
        self.child: subprocess.Popen[bytes] | None = None
        self.trainer_session = os.getsid(parent)
        self.trainer = next((p for p in living_processes() if p.pid == parent), None)
        self.trainer_cmdline = _cmdline(parent)
        self.trainer_children: dict[int, ProcStat] = {}
        self.run_tmpdir = os.environ.get(RUN_TMPDIR_ENV)

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # An ignored signal stays ignored, also for the server (a handled one would be reset to the
            # default action, death, in the program it starts).
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, self._on_signal)
        if os.getppid() != self.parent:  # the trainer died while this process started
            self._remove_leftovers()
            self._after_the_trainer()
            return 1
        env = dict(os.environ, TMPDIR=str(self.tmpdir))
        if self.key:
            env[API_KEY_ENV] = self.key
        self.child = subprocess.Popen(
            # this module, also when it runs as __main__
            [sys.executable, "-m", __spec__.name, "--serve", str(os.getpid()), *self.server],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        copier = threading.Thread(target=self._copy_output, name="engine-log", daemon=True)
        copier.start()
        next_scan = 0.0
        while self.child.poll() is None and not self.stop.is_set() and os.getppid() == self.parent:
            if time.monotonic() >= next_scan:
                self._scan()
                next_scan = time.monotonic() + _SCAN_EVERY_S
            self.stop.wait(_POLL_S)
        self._scan()
        code = self._stop_server()
        copier.join(timeout=5.0)
        self._remove_leftovers()
        if os.getppid() != self.parent:
            self._after_the_trainer()
        return code

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop.set()

    def _copy_output(self) -> None:
        assert self.child is not None and self.child.stdout is not None
        secret = self.key.encode() if self.key else None
        with open(self.log, "ab") as log:
            for line in self.child.stdout:
                log.write(line.replace(secret, REDACTED.encode()) if secret else line)
                log.flush()

    def _scan(self) -> None:
        table = living_processes()
        for proc in table:
            if proc.session == os.getpid() and proc.pid != os.getpid():
                self.pids_seen.add(proc.pid)
                self.slot_files |= slot_files_held(proc.pid)
        for proc in descendants(self.parent, self.trainer_session, table):
            self.trainer_children[proc.pid] = proc

    def _after_the_trainer(self) -> None:
        """The trainer is gone without stopping what it started: SIGKILL its processes this guard saw, but
        give multiprocessing's resource tracker a moment to leave by itself once the others are gone, as it
        removes the semaphores and shared memory they registered."""
        left = _still_alive(p for p in self.trainer_children.values() if p.pid != os.getpid())
        left += [p for p in self._late_forks() if p not in left]
        tracker = [p for p in left if b"resource_tracker" in _cmdline(p.pid)]
        for proc in left:
            if proc not in tracker:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + GRACE_S
        while (tracker := _still_alive(tracker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in tracker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        # torch's shared-memory manager, which would unlink the trainer's segments once their users are gone,
        # was one of the processes just killed.
        _remove_torch_segments({self.parent} | set(self.trainer_children) | {p.pid for p in left})
        if self.run_tmpdir:
            shutil.rmtree(self.run_tmpdir, ignore_errors=True)

    def _late_forks(self) -> list[ProcStat]:
        """Children the trainer forked after the last scan (a checkpoint writer forked just before a SIGKILL):
        orphaned now, they are in its session, started after it and still carry its command line. Its
        siblings (other ranks under the same launcher) carry that command line too, but have the trainer's
        parent; their own forks have a parent with that command line."""
        if self.trainer is None:
            return []
        return [
            proc
            for proc in living_processes()
            if proc.session == self.trainer_session
            and proc.started >= self.trainer.started
            and proc.ppid != self.trainer.ppid
            and proc.pid not in (os.getpid(), self.parent)
            and _cmdline(proc.pid) == self.trainer_cmdline
            and _cmdline(proc.ppid) != self.trainer_cmdline
        ]

    def _stop_server(self) -> int:
        assert self.child is not None
        running = self.child.poll() is None
        killed = running and self.stop_by_kill
        if running and not killed:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(timeout=GRACE_S)
        deadline = time.monotonic() + GRACE_S
        while (left := [p for p in session_members(os.getpid()) if p != os.getpid()]) and (
            time.monotonic() < deadline
        ):
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        code = self.child.wait()
        if killed and code == -signal.SIGKILL:
            return 0  # stopped as asked
        return 128 - code if code < 0 else code

    def _remove_leftovers(self) -> None:
        remove_slot_files(self.slot_files | abandoned_slot_files(self.started))
        _remove_torch_segments(self.pids_seen)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _remove_torch_segments(pids: set[int]) -> None:
    """Unlink torch's `torch_<pid>_*` shared-memory segments created by those of `pids` that are gone (a
    zombie counts as gone: the trainer's launcher may not have reaped it yet)."""
    living = {proc.pid for proc in living_processes()}
    with contextlib.suppress(OSError):
        for path in _SHM.iterdir():
            match = _TORCH_SEGMENT.match(path.name)
            if match and int(match.group(1)) in pids - living:
                path.unlink(missing_ok=True)


def _die_with(parent: int) -> None:
    """SIGKILL this process when `parent`, which started it from its main thread, dies. Should the guard be
    killed itself, the server goes at once, and its workers with it (they die with their launcher)."""
    with contextlib.suppress(AttributeError, OSError):  # Linux only; elsewhere the guard's own SIGKILLs do
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request
        os._exit(1)


def _serve(parent: int, module: str, args: list[str]) -> None:
    """Inside the server process: tied to the guard, the key from the environment onto the arguments, then
    the server."""
    _die_with(parent)
    key = os.environ.pop(API_KEY_ENV, None)
    if key:
        # `=`: a key may start with "-", which argparse would take for an option.
        args = [*args, f"--api-key={key}", f"--admin-api-key={key}"]
    sys.argv = [module, *args]
    # As `python -m MODULE`.
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        _serve(int(argv[1]), argv[2], argv[3:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m dapo_megatron.rollout.engine_guard")
    parser.add_argument("--parent", type=int, required=True, help="the trainer's pid")
    parser.add_argument("--log", type=Path, required=True, help="where the server's output goes")
    parser.add_argument("--tmpdir", type=Path, required=True, help="the server's TMPDIR, removed afterwards")
    parser.add_argument(
        "--stop-by-kill", action="store_true", help="stop the server with SIGKILL, not its graceful shutdown"
    )
    parser.add_argument("server", nargs="+", help="MODULE [ARGS...] of the server, after --")
    args = parser.parse_args(argv)
    return Guard(args.parent, args.log, args.tmpdir, args.server, stop_by_kill=args.stop_by_kill).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
