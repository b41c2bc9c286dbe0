"""Fault injection: the demo-sized job is killed, starved and fed hostile input at points a seed picks, and
must recover every time without leaving anything behind.

    python bench/faults.py [--repeats N] [--seed S] [--types a,b,...] [--work DIR] [--repo DIR] [--json FILE]

Faults (each `--repeats` times):
    kill_generation, kill_update, kill_sync, kill_checkpoint
                        SIGKILL of the trainer process (only it: its engine must notice) at a random moment
                        inside that phase of a random step. Phases are the trainer's own DEBUG lines
                        (`step N: generate|update|weight sync|synced|checkpoint|checkpoint written`); the
                        delay after a phase's line is drawn within that phase's last observed duration.
    kill_engine         SIGKILL of the SGLang scheduler at a random moment of a random step; the trainer must
                        stop with an error naming the engine.
    disk_full           writes into a random step's checkpoint fail with ENOSPC after a random number of bytes
                        (`faults_site/sitecustomize.py`); the trainer must stop with that error, the previous
                        checkpoint must stay complete.
    corrupt_checkpoint  the newest checkpoint's tracker or one of its files is truncated or has bytes flipped
                        before a resume; the resume must skip it, say so, and take the one before.
    reward_hang_crash   the real RewardPool with a scorer that hangs (GIL-holding loop or sleep), raises,
                        exits or segfaults on random samples: those score as wrong (timeout/error), the others
                        as the real scorer says, and the pool keeps working.
    hostile_answers     overflowing, underflowing, NaN-producing, huge-exponent and nested-radical answers
                        (the property test's generator) through the real scorer with symbolic equivalence on,
                        against unrelated ground truths: never +1 (and controls that must be +1 are).

The job faults run as one chain of trainer processes in one output directory: each launch resumes from
what the fault before it left (`trainer.resume=auto`) and is ended by its own fault; a last launch checks the
last resume and stops with SIGTERM. A launch checks that it started from the newest committed checkpoint
(the tracker's, or the one before when that was damaged on purpose). After every process exit the run's
processes (a marker in their environment, plus every descendant seen), the /dev/shm files they mapped or
that carry their pids, and the run's TMPDIR must be gone within a grace period; leftovers are counted, then
removed.

Figures: faults_injected, recovered (resumed from the newest complete checkpoint, or stopped with the clear
error a stopping fault calls for; rewards as expected), orphans_left (processes), shm_left, temp_left,
checkpoints_lost (committed checkpoints that no longer verify, or resumes that went back past one),
false_rewards, per fault type.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_runs import DEMO_BASE, REPO, bench_env, ensure_base, tail

MARKER = "DAPO_FAULT_RUN"
SITE = Path(__file__).resolve().parent / "faults_site"
KILLS = ("kill_generation", "kill_update", "kill_sync", "kill_checkpoint")
STOPPING = {"kill_engine": r"the SGLang engine (died|exited)", "disk_full": r"No space left on device"}
JOB_FAULTS = (*KILLS, *STOPPING)
CHEAP_FAULTS = ("reward_hang_crash", "hostile_answers")
ALL_FAULTS = (*JOB_FAULTS, "corrupt_checkpoint", *CHEAP_FAULTS)
SMALL_JOB = [
    "experiment=demo",
    "eval.every=0",
    "trainer.save_every=1",
    "trainer.total_steps=1000",  # every launch ends by its fault; the LR schedule stays the same across them
    "trainer.train_batch_size=4",
    "trainer.gen_batch_size=4",  # no more than a batch: every step generates (none fills from carry-over)
    "trainer.ppo_mini_batch_size=2",
    "rollout.n_samples_per_prompt=8",
    "trainer.max_gen_rounds=2",
    "trainer.on_unfilled_batch=train",
    "trainer.log_level=DEBUG",  # the phase lines the kills aim at
]
"""The demo at its smallest: a step is seconds, start-up dominates a launch."""
GRACE_S = 60.0
"""How long the run's processes, shared memory and temp files may take to go after the trainer exits."""
START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    kind: str
    injected: bool = False
    landed: bool = False
    """The fault hit the phase it was aimed at (kills only; the others always land where aimed)."""
    recovered: bool = False
    orphans: int = 0
    shm_left: int = 0
    temp_left: int = 0
    checkpoints_lost: int = 0
    false_rewards: int = 0
    detail: str = ""


# ---------------------------------------------------------------- the run's processes and what they leave


@dataclass
class Footprint:
    """Everything one launch (or child) of the run owns: processes seen, /dev/shm files, its TMPDIR."""

    token: str
    tmpdir: Path
    processes: dict[int, float] = field(default_factory=dict)  # pid -> create time
    shm: set[str] = field(default_factory=set)
    shm_before: set[str] = field(default_factory=set)

    @classmethod
    def new(cls) -> Footprint:
        token = uuid.uuid4().hex
        # Short: sockets live in it (AF_UNIX paths are limited to 108 bytes).
        tmpdir = Path(tempfile.mkdtemp(prefix=f"fault-{token[:8]}-"))
        return cls(token, tmpdir, shm_before=set(os.listdir("/dev/shm")))

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**bench_env(), MARKER: self.token, "TMPDIR": str(self.tmpdir), **(extra or {})}

    def scan(self, root: int | None = None) -> list[psutil.Process]:
        """Record (and return) the live processes of the run: the marker in their environment, or below
        `root`."""
        found: dict[int, psutil.Process] = {}
        if root is not None:
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(root)
                found.update({p.pid: p for p in [top, *top.children(recursive=True)]})
        needle = f"{MARKER}={self.token}".encode()
        for pid in psutil.pids():
            if pid in found or pid == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{pid}/environ").read_bytes():
                    with contextlib.suppress(psutil.Error):
                        found[pid] = psutil.Process(pid)
        for pid, process in found.items():
            with contextlib.suppress(psutil.Error):
                self.processes.setdefault(pid, process.create_time())
                self.shm |= _shm_in_use(pid)
        return list(found.values())

    def alive(self) -> list[psutil.Process]:
        """Processes recorded earlier that still run (same pid and start time: not a reused pid), or carry
        the marker."""
        survivors = {p.pid: p for p in self.scan()}
        for pid, created in self.processes.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    survivors[pid] = process
        return [p for p in survivors.values() if _not_zombie(p)]

    def leftovers(self) -> tuple[list[psutil.Process], list[str], list[str]]:
        pids = {str(pid) for pid in self.processes}
        new = set(os.listdir("/dev/shm")) - self.shm_before
        carrying_pid = {f"/dev/shm/{n}" for n in new if pids & set(re.split(r"[_.\-]", n))}
        shm = sorted(path for path in self.shm | carrying_pid if os.path.exists(path))
        # torch's compile cache stays in TMPDIR on purpose, for the next process; not a leak.
        entries = os.listdir(self.tmpdir) if self.tmpdir.exists() else []
        temp = sorted(name for name in entries if not name.startswith("torchinductor_"))
        return self.alive(), shm, temp

    def settle(self, grace_s: float = GRACE_S) -> tuple[int, int, int, str]:
        """Wait up to `grace_s` for the run's processes and shared memory to go (temp files of a killed
        process stay whatever the wait); count and remove what stays."""
        deadline = time.monotonic() + grace_s
        while True:
            processes, shm, temp = self.leftovers()
            if not (processes or shm) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        detail = ""
        if processes or shm or temp:
            names = [f"{p.pid}:{_name(p)} {' '.join(_cmdline(p))[:120]}" for p in processes]
            detail = f"left: processes {names} shm {shm} temp {temp[:5]}"
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.kill()
        for path in shm:
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return len(processes), len(shm), len(temp), detail


def _shm_in_use(pid: int) -> set[str]:
    paths: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "/dev/shm/" in line and not line.endswith("(deleted)"):
                paths.add(line[line.index("/dev/shm/") :])
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/") and not target.endswith("(deleted)"):
                    paths.add(target)
    return paths


def _not_zombie(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "?"


# ---------------------------------------------------------------- one launch of the trainer


class Follow:
    """The lines a growing file gained since the last call."""

    def __init__(self, path: Path, *, from_end: bool) -> None:
        self.path, self.pending = path, ""
        self.offset = path.stat().st_size if from_end and path.exists() else 0

    def lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with self.path.open(errors="replace") as stream:
            if stream.seek(0, os.SEEK_END) < self.offset:  # truncated by a new launch: start over
                self.offset = 0
            stream.seek(self.offset)
            chunk = stream.read()
            self.offset = stream.tell()
        self.pending += chunk
        *done, self.pending = self.pending.split("\n")
        return done


PHASE_LINE = re.compile(r"^step (\d+): (generate|update|weight sync|synced|checkpoint|checkpoint written)$")
KILL_PHASES = {
    "kill_generation": "generate",
    "kill_update": "update",
    "kill_sync": "weight sync",
    "kill_checkpoint": "checkpoint",
    "kill_engine": "generate",
}


@dataclass
class Phases:
    """Where the job is, from the trainer's DEBUG phase lines: the newest `(step, phase)`, when its line was
    seen, and the shortest each phase has lasted (the kills draw their delay within it: a first step's
    phases, slower, would carry a kill past the end of a later step's)."""

    current: tuple[int, str] | None = None
    since: float = 0.0
    lasted: dict[str, float] = field(default_factory=dict)

    def feed(self, line: str, now: float) -> None:
        match = PHASE_LINE.match(line.strip())
        if not match:
            return
        if self.current is not None:
            phase = self.current[1]
            self.lasted[phase] = min(now - self.since, self.lasted.get(phase, float("inf")))
        self.current, self.since = (int(match.group(1)), match.group(2)), now

    def at(self, step: int, phase: str) -> bool:
        return self.current == (step, phase)

    def past(self, step: int, phase: str) -> bool:
        """The job reached (or went beyond) `phase` of `step`."""
        order = ("generate", "update", "weight sync", "synced", "checkpoint", "checkpoint written")
        return self.current is not None and (self.current[0], order.index(self.current[1])) >= (
            step,
            order.index(phase),
        )


class Launch:
    """One trainer process of the chain, in its own process group, with its console in a file."""

    def __init__(
        self,
        repo: Path,
        out: Path,
        base: Path,
        index: int,
        env: dict[str, str],
        overrides: Sequence[str],
    ) -> None:
        self.out = out
        self.footprint = Footprint.new()
        self.console_path = out.parent / f"console_{index:03d}.txt"
        self.metrics = Follow(out / "tensorboard" / "metrics.jsonl", from_end=True)
        self.console = Follow(self.console_path, from_end=False)
        self.phases = Phases()
        self.start_step: int | None = None
        self.steps: list[int] = []
        self._last_scan = 0.0
        pythonpath = os.pathsep.join(filter(None, [str(SITE), str(repo), os.environ.get("PYTHONPATH")]))
        command = [
            sys.executable,
            "-m",
            "dapo_megatron.train",
            *SMALL_JOB,
            f"model.hf_dir={base}",
            f"output_dir={out}",
            *overrides,
        ]
        with self.console_path.open("w") as sink:
            self.proc = subprocess.Popen(
                command,
                cwd=repo,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.footprint.env({"PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **env}),
            )

    def poll(self, *, scan: bool = True) -> bool:
        """Take in the new log lines (and every 2 s, unless not to `scan`, the run's processes: a look at
        all of /proc, too slow for a wait that aims at a phase); False once the trainer has exited."""
        now = time.monotonic()
        for line in self.console.lines():
            self.phases.feed(line, now)
        for line in self.metrics.lines():
            record = json.loads(line)
            if "startup/total_s" in record and self.start_step is None:
                self.start_step = int(record["step"])
            elif "timing_s/step" in record:
                self.steps.append(int(record["step"]))
        if scan and time.monotonic() - self._last_scan > 2.0:
            self.footprint.scan(self.proc.pid)
            self._last_scan = time.monotonic()
        return self.proc.poll() is None

    def wait_for(self, condition: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if not self.poll(scan=interval >= 0.1) or time.monotonic() > deadline:
                return condition()
            time.sleep(interval)
        return True

    def wait_started(self) -> int | None:
        self.wait_for(lambda: self.start_step is not None, START_TIMEOUT_S, 0.2)
        return self.start_step

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)
        self.footprint.scan()  # the family, by its marker (the dead trainer's children are orphans now)

    def finish(self, timeout: float) -> int | None:
        """The trainer's exit code (None: it did not exit in time and was killed), after its footprint
        settled."""
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            self.kill()
            self.proc.wait()
        self.poll()
        return code

    def text(self) -> str:
        return self.console_path.read_text(errors="replace")


# ---------------------------------------------------------------- injecting into a launch


def inject(kind: str, launch: Launch, start: int, rng: random.Random) -> tuple[bool, bool, str]:
    """Aim `kind` at a random moment of its phase (`KILL_PHASES`) in a random step after `start` (the
    launch's first); (injected, landed, detail). Landed: the trainer, once dead, had not begun the next
    phase (its phase lines are written unbuffered, so the console read after the kill is complete)."""
    # The first or second step of the launch; of a fresh job the second or third, so that a checkpoint is
    # committed before the fault.
    step = start + rng.randint(1, 2) + (start == 0)
    phase, ph = KILL_PHASES[kind], launch.phases
    if not launch.wait_for(lambda: ph.past(step, phase), STOP_TIMEOUT_S, 0.002):
        return False, False, f"the trainer exited (code {launch.proc.returncode}) before step {step}: {phase}"
    reached = ph.at(step, phase)
    # Within the phase's shortest observed length (before any: a guess).
    time.sleep(rng.uniform(0.0, 0.9 * ph.lasted.get(phase, 0.3)))
    if kind == "kill_engine":
        schedulers = [p for p in launch.footprint.scan(launch.proc.pid) if "scheduler" in _name(p)]
        if not schedulers:
            return False, False, "no scheduler process found"
        schedulers[0].kill()
        return True, True, f"scheduler {schedulers[0].pid} killed in step {step} ({phase})"
    if launch.proc.poll() is not None:
        return False, False, f"the trainer exited (code {launch.proc.returncode}) before the fault"
    launch.kill()
    launch.proc.wait()
    launch.poll()
    landed = reached and ph.at(step, phase)
    where = f"{phase} of step {step}"
    return True, landed, f"SIGKILL in {where}" if landed else f"SIGKILL aimed at {where}, at {ph.current}"


def corrupt(directory: Path, rng: random.Random) -> str:
    """Truncate, or flip bytes of, the tracker or one file of the newest checkpoint; what was done."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    target = rng.choice([directory.parent / "latest_checkpointed_iteration.txt", *files])
    data = bytearray(target.read_bytes())
    if rng.random() < 0.5 or len(data) < 2:
        size = rng.randrange(0, max(len(data), 1))
        target.write_bytes(bytes(data[:size]))
        return f"{target.relative_to(directory.parent)} cut from {len(data)} to {size} bytes"
    positions = sorted(rng.sample(range(len(data)), k=min(len(data), rng.randint(1, 4))))
    for position in positions:
        data[position] ^= 0xFF
    target.write_bytes(bytes(data))
    return f"{target.relative_to(directory.parent)} bytes {positions} flipped"


# ---------------------------------------------------------------- the chain of launches


class Checkpoints:
    """What the chain knows of its checkpoints, independently of the trainer's own resolution: committed are
    the tracker's step and every finished directory before it (the tracker only moves forward, after its
    directory is complete); damaged: corrupted on purpose (the directory's inode then: a resumed run that
    writes that step again replaces the directory, and the step is intact again); lost: committed ones that
    stopped verifying."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.committed, self.lost, self.finished = set[int](), set[int](), set[int]()
        self.damaged_inodes: dict[int, int] = {}

    @property
    def damaged(self) -> set[int]:
        return set(self.damaged_inodes)

    def damage(self, step: int) -> None:
        self.damaged_inodes[step] = (self.root / f"iter_{step:07d}").stat().st_ino

    def update(self) -> None:
        from dapo_megatron.checkpoint import verify

        self.finished = {
            int(m.group(1))
            for p in (self.root.iterdir() if self.root.is_dir() else [])
            if (m := re.fullmatch(r"iter_(\d+)", p.name))
        }
        for step, inode in list(self.damaged_inodes.items()):
            with contextlib.suppress(OSError):
                if (self.root / f"iter_{step:07d}").stat().st_ino != inode:
                    del self.damaged_inodes[step]
        with contextlib.suppress(OSError):
            match = re.fullmatch(
                r"(\d+)\n", (self.root / "latest_checkpointed_iteration.txt").read_text(errors="replace")
            )
            if match:
                tracked = int(match.group(1))
                self.committed |= {step for step in self.finished if step <= tracked}
        for step in sorted(self.committed - self.damaged - self.lost):
            if verify(self.root / f"iter_{step:07d}") is not None:
                self.lost.add(step)

    def newest_intact(self) -> int:
        return max(self.committed - self.damaged - self.lost, default=0)


def run_chain(
    plan: Sequence[tuple[str, bool]],
    work: Path,
    base: Path,
    repo: Path,
    rng: random.Random,
    report: Callable[[str], None] = print,
    overrides: Sequence[str] = (),
) -> list[Outcome]:
    """Launch after launch in one output directory: `plan` lists each launch's fault and whether the newest
    checkpoint is damaged before it (`plan_chain`); the last one, `sigterm_stop`, checks the last resume."""
    out = work / "job"
    checkpoints = Checkpoints(out / "checkpoints")
    outcomes: list[Outcome] = []
    waiting: list[Outcome] = []  # faults whose recovery the next launch shows
    pending_damage = False
    for index, (kind, damage) in enumerate(plan):
        checkpoints.update()
        expected = checkpoints.newest_intact()
        corruption: Outcome | None = None
        # Damage only where an older complete checkpoint remains to fall back on (with none, the trainer's
        # refusal to start is the right answer, and the chain could not go on); else at a later launch.
        pending_damage = pending_damage or damage
        if pending_damage and len(checkpoints.committed - checkpoints.damaged - checkpoints.lost) >= 2:
            pending_damage = False
            newest = checkpoints.newest_intact()
            if newest:
                detail = corrupt(out / "checkpoints" / f"iter_{newest:07d}", rng)
                if "latest_checkpointed_iteration" not in detail:
                    checkpoints.damage(newest)
                corruption = Outcome("corrupt_checkpoint", injected=True, landed=True, detail=detail)
                waiting.append(corruption)
                expected = checkpoints.newest_intact()
        env: dict[str, str] = {}
        if kind == "disk_full":
            # The trainer resumes from a finished directory newer than the tracker's step too.
            step = max(checkpoints.finished - checkpoints.damaged, default=expected) + rng.randint(1, 2)
            env = {
                "DAPO_FAULT_ENOSPC_DIR": str(out / "checkpoints" / f"iter_{step:07d}.partial"),
                "DAPO_FAULT_ENOSPC_BYTES": str(rng.randrange(0, 700_000)),
                "DAPO_FAULT_ENOSPC_REPORT": str(work / f"enospc_{index:03d}.txt"),
            }
        first = ["trainer.resume=never"] if index == 0 else []
        launch = Launch(repo, out, base, index, env, [*overrides, *first])
        start = launch.wait_started()
        # A newer directory than the tracker's (killed between its rename and the tracker) is complete too.
        resumed_ok = start is not None and start >= expected and start in {0, *checkpoints.finished}
        for earlier in waiting:
            earlier.recovered = resumed_ok and (earlier.recovered or earlier.kind not in STOPPING)
            if earlier.kind == "corrupt_checkpoint":
                earlier.recovered = resumed_ok and "checkpoint: using" in launch.text()
            if not resumed_ok:
                earlier.detail += f"; resumed at {start}, newest complete checkpoint {expected}"
                if start is not None and start < expected:
                    earlier.checkpoints_lost += 1
        waiting = []
        outcome = Outcome(kind)
        if start is None:
            outcome.detail = f"no start within {START_TIMEOUT_S:.0f}s: {tail(launch.console_path, 5)}"
            launch.kill()
        elif kind == "sigterm_stop":
            launch.wait_for(lambda current=launch: bool(current.steps), STOP_TIMEOUT_S, 0.2)
            launch.kill(signal.SIGTERM)
            outcome.injected = outcome.landed = True
        elif kind == "disk_full":
            launch.wait_for(lambda: False, STOP_TIMEOUT_S, 0.2)  # until it stops by itself
            outcome.injected = outcome.landed = Path(env["DAPO_FAULT_ENOSPC_REPORT"]).exists()
        else:
            outcome.injected, outcome.landed, outcome.detail = inject(kind, launch, start, rng)
        code = launch.finish(STOP_TIMEOUT_S)
        orphans, shm, temp, left = launch.footprint.settle()
        outcome.orphans, outcome.shm_left, outcome.temp_left = orphans, shm, temp
        outcome.detail = "; ".join(filter(None, [outcome.detail, f"exit {code}", left]))
        if kind in STOPPING:
            # Recovered only once the next launch resumed; here: it stopped, with the clear error.
            outcome.recovered = code not in (0, None) and bool(re.search(STOPPING[kind], launch.text()))
            if not outcome.recovered and outcome.injected:
                outcome.detail += f"; console: {tail(launch.console_path, 3)}"
        if kind == "sigterm_stop":
            outcome.recovered = code == 0
        checkpoints.update()
        if outcome.injected and kind != "sigterm_stop":
            waiting.append(outcome)
        outcomes += [o for o in (corruption, outcome) if o is not None]
        # A long run's outcomes so far, should it be cut short (the last ones await the next launch).
        (work / "outcomes.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
        report(f"launch {index}: {kind} started at {start} (expected >= {expected}): {outcome.detail}")
    checkpoints.update()
    if checkpoints.lost:
        outcomes[-1].checkpoints_lost += len(checkpoints.lost)
        outcomes[-1].detail += f"; committed checkpoints that no longer verify: {sorted(checkpoints.lost)}"
    return outcomes


# ---------------------------------------------------------------- faults the reward pool must absorb

SCORER_FAULTS = ("spin", "sleep", "raise", "exit", "segfault")
EXPECTED_STATUS = {
    "": "ok",
    "spin": "timeout",
    "sleep": "timeout",
    "raise": "error",
    "exit": "error",
    "segfault": "error",
}


def faulty_score(solution: str, ground_truth: str, data_source: str, *, config: Any) -> dict[str, object]:
    """The real scorer, unless the solution ends with `#fault=<kind>`: then it misbehaves that way."""
    from dapo_megatron.rewards.registry import score_sample

    solution, _, fault = solution.partition("#fault=")
    if fault == "spin":  # holds the GIL: only killing the worker ends it
        while True:
            pass
    if fault == "sleep":
        time.sleep(3600)
    if fault == "raise":
        raise RuntimeError("injected scorer failure")
    if fault == "exit":
        os._exit(3)
    if fault == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    return score_sample(solution, ground_truth, data_source, config=config)


def reward_faults(rng: random.Random) -> Outcome:
    """One batch through the real RewardPool with a misbehaving scorer on random samples, then a clean batch
    through the same pool; after close, none of its workers may run."""
    import faults  # this file under its module name, so that the workers can unpickle the scorer

    from dapo_megatron.rewards.config import RewardConfig
    from dapo_megatron.rewards.pool import RewardPool

    config = RewardConfig(num_workers=2, timeout_s=2.0)
    cases = []
    for _ in range(12):
        answer, truth = rng.randint(0, 99), rng.randint(0, 99) if rng.random() < 0.5 else None
        truth = answer if truth is None else truth
        fault = rng.choice(["", "", *SCORER_FAULTS])
        cases.append((answer, truth, fault))
    cases[rng.randrange(len(cases))] = (1, 1, rng.choice(SCORER_FAULTS))  # at least one fault
    items = [(f"Answer: {a}" + (f"#fault={f}" if f else ""), str(t), "math_dapo") for a, t, f in cases]
    outcome = Outcome("reward_hang_crash", injected=True, landed=True)
    problems: list[str] = []
    with RewardPool(config, functools.partial(faults.faulty_score, config=config)) as pool:
        workers = [w.process.pid for w in pool._workers]
        results = pool.score(items)
        for (answer, truth, fault), result in zip(cases, results, strict=True):
            right = fault == "" and answer == truth
            expected = (EXPECTED_STATUS[fault], config.correct_score if right else config.wrong_score)
            if (result.status, result.score) != expected:
                problems.append(f"{fault or 'no fault'} {answer} vs {truth}: {result.status} {result.score}")
            outcome.false_rewards += fault != "" and result.score == config.correct_score
        clean = pool.score([("Answer: 7", "7", "math_dapo"), ("Answer: 7", "8", "math_dapo")])
        if [r.score for r in clean] != [config.correct_score, config.wrong_score]:
            problems.append(f"the pool scored wrongly after the faults: {clean}")
        workers += [w.process.pid for w in pool._workers]
    outcome.orphans = sum(psutil.pid_exists(pid) and _not_zombie(psutil.Process(pid)) for pid in workers)
    outcome.recovered = not problems
    outcome.detail = "; ".join(problems) or f"faults {[f for _, _, f in cases if f]}"
    return outcome


def hostile_cases(count: int, seed: int) -> list[tuple[str, str, str]]:
    """`count` draws of the symbolic property test's hostile values, as (answer, other, unrelated ground
    truth), reproducibly from `seed`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # after the package under test, which may be another checkout
    from tests.unit.test_rewards_symbolic import UNRELATED_GROUND_TRUTHS, hostile_scalars

    drawn: list[tuple[str, str, str]] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.tuples(hostile_scalars(), hostile_scalars(), st.sampled_from(UNRELATED_GROUND_TRUTHS)))
    def collect(case: tuple[str, str, str]) -> None:
        drawn.append(case)

    collect()
    return drawn[:count]


CONTROLS = [("Answer: \\frac{1}{2}", "0.5"), ("Answer: 2\\sqrt{3}", "\\sqrt{12}")]
"""Equivalent only through the symbolic check: they show it is on and can give +1."""


def hostile_answers(rng: random.Random, count: int = 16) -> Outcome:
    from dapo_megatron.rewards.config import RewardConfig
    from dapo_megatron.rewards.pool import RewardPool

    config = RewardConfig(num_workers=2, symbolic_equivalence=True)
    items = []
    for hostile, other, truth in hostile_cases(count, rng.randrange(2**32)):
        items += [
            (f"Answer: {hostile}", truth, "math_dapo"),
            (f"Answer: ({hostile}, {other})", f"({truth}, 2)", "math_dapo"),
        ]
    with RewardPool(config) as pool:
        results = pool.score([*items, *[(a, t, "math_dapo") for a, t in CONTROLS]])
    hostile, controls = results[: len(items)], results[len(items) :]
    false = [item[:2] for item, r in zip(items, hostile, strict=True) if r.score == config.correct_score]
    outcome = Outcome("hostile_answers", injected=True, landed=True, false_rewards=len(false))
    controls_ok = all(r.score == config.correct_score for r in controls)
    outcome.recovered = not false and controls_ok
    outcome.detail = f"{len(items)} answers; +1 for {false[:3]}" if false else f"{len(items)} answers"
    if not controls_ok:
        outcome.detail += "; the controls did not score +1: is the symbolic check on?"
    return outcome


def run_cheap(kinds: Sequence[str], repeats: int, seed: int, work: Path) -> list[Outcome]:
    """The reward faults in a child process carrying the marker (its pool's fork server and workers must go
    with it); its outcomes come back as JSON."""
    footprint = Footprint.new()
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            ",".join(kinds),
            "--repeats",
            str(repeats),
            "--seed",
            str(seed),
        ],
        cwd=REPO,
        env=footprint.env(),
        capture_output=True,
        text=True,
        timeout=600 + 60 * repeats,
    )
    footprint.scan()
    if proc.returncode != 0:
        raise RuntimeError(f"the reward-fault child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    outcomes = [Outcome(**entry) for entry in json.loads(proc.stdout.strip().splitlines()[-1])]
    orphans, shm, temp, left = footprint.settle()
    if outcomes:
        outcomes[-1].orphans += orphans
        outcomes[-1].shm_left += shm
        outcomes[-1].temp_left += temp
        outcomes[-1].detail += f"; {left}" if left else ""
    return outcomes


def child(kinds: Sequence[str], repeats: int, seed: int) -> None:
    rng = random.Random(seed)
    runners = {"reward_hang_crash": reward_faults, "hostile_answers": hostile_answers}
    outcomes = [runners[kind](rng) for _ in range(repeats) for kind in kinds]
    print(json.dumps([asdict(o) for o in outcomes]))


# ---------------------------------------------------------------- the whole suite


def plan_chain(
    kinds: Sequence[str], repeats: int, corruptions: int, rng: random.Random
) -> list[tuple[str, bool]]:
    """Each job fault `repeats` times in a random order, then a launch that stops with SIGTERM; `corruptions`
    random launches after the first start on a damaged newest checkpoint."""
    faults_ = [kind for kind in kinds for _ in range(repeats)] or ["kill_checkpoint"] * corruptions
    rng.shuffle(faults_)
    faults_.append("sigterm_stop")
    damaged = set(rng.sample(range(1, len(faults_)), k=min(corruptions, len(faults_) - 1)))
    return [(kind, index in damaged) for index, kind in enumerate(faults_)]


FIGURES = (
    "faults_injected",
    "recovered",
    "orphans_left",
    "shm_left",
    "temp_left",
    "checkpoints_lost",
    "false_rewards",
)


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    def figures(group: Sequence[Outcome]) -> dict[str, int]:
        return {
            "faults_injected": sum(o.injected for o in group),
            "landed": sum(o.landed for o in group),
            "recovered": sum(o.recovered for o in group if o.injected),
            "orphans_left": sum(o.orphans for o in group),
            "shm_left": sum(o.shm_left for o in group),
            "temp_left": sum(o.temp_left for o in group),
            "checkpoints_lost": sum(o.checkpoints_lost for o in group),
            "false_rewards": sum(o.false_rewards for o in group),
        }

    kinds = dict.fromkeys(o.kind for o in outcomes)
    return {**figures(outcomes), "by_type": {k: figures([o for o in outcomes if o.kind == k]) for k in kinds}}


def run_suite(
    kinds: Sequence[str],
    repeats: int,
    seed: int,
    work: Path,
    *,
    base: Path,
    repo: Path,
    report: Callable[[str], None] = print,
) -> list[Outcome]:
    rng = random.Random(seed)
    outcomes = []
    cheap = [k for k in kinds if k in CHEAP_FAULTS]
    if cheap:
        outcomes += run_cheap(cheap, repeats, rng.randrange(2**32), work)
        for outcome in outcomes:
            report(
                f"{outcome.kind}: {'recovered' if outcome.recovered else 'NOT recovered'}: {outcome.detail}"
            )
    job = [k for k in kinds if k in JOB_FAULTS]
    corruptions = repeats if "corrupt_checkpoint" in kinds else 0
    if job or corruptions:
        outcomes += run_chain(plan_chain(job, repeats, corruptions, rng), work, base, repo, rng, report)
    return outcomes


def print_summary(summary: dict[str, Any]) -> None:
    for name in FIGURES:
        print(f"{name}: {summary[name]}")
    width = max(map(len, summary["by_type"]), default=4)
    print(f"\n{'fault':{width}}  injected  landed  recovered  orphans  shm  temp  ckpt_lost  false_rewards")
    for kind, f in summary["by_type"].items():
        print(
            f"{kind:{width}}  {f['faults_injected']:8d}  {f['landed']:6d}  {f['recovered']:9d}  "
            f"{f['orphans_left']:7d}  {f['shm_left']:3d}  {f['temp_left']:4d}  {f['checkpoints_lost']:9d}  "
            f"{f['false_rewards']:13d}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=10, help="injections of each fault type")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--types", default=",".join(ALL_FAULTS), help=f"comma-separated, of {ALL_FAULTS}")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "faults", help="scratch (emptied)")
    parser.add_argument("--base", type=Path, default=DEMO_BASE, help="the demo base (built if missing)")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose trainer runs")
    parser.add_argument("--json", type=Path, help="also write every outcome and the summary here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child.split(","), args.repeats, args.seed)
        return 0
    kinds = args.types.split(",")
    unknown = sorted(set(kinds) - set(ALL_FAULTS))
    if unknown:
        parser.error(f"unknown fault types {unknown}; choose from {', '.join(ALL_FAULTS)}")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    base = ensure_base(args.base)
    outcomes = run_suite(kinds, args.repeats, args.seed, args.work, base=base, repo=args.repo.resolve())
    summary = summarize(outcomes)
    print_summary(summary)
    if args.json:
        args.json.write_text(
            json.dumps({"summary": summary, "outcomes": [asdict(o) for o in outcomes]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
