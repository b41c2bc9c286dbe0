"""Lifecycle of one SGLang server process tree: launch, health, memory release/resume, shutdown.

One `SGLangEngine` is one HTTP server (on GPU: one per rollout tensor-parallel group). The trainer
talks to it over HTTP only, so the engine runs in its own process group and never shares CUDA or
Python state with the trainer.

The device backend (`backends/`) owns the server's command line, what its environment adds, and what the
device refuses: on CPU `backends/sglang_cpu.py` with SGLang's native-torch backends, on CUDA
`sglang.launch_server` with `--enable-memory-saver`, so that `release_memory` can free the weights and KV
cache while megatron trains.

Every engine is started through `rollout/engine_guard.py`, which gives it a per-engine API key without
putting the key on a command line or in the log (`rollout/engine_auth.py` sends it with every request), a
temporary folder of its own, and the guarantee that it does not outlive the trainer: the guard stops the
server and everything in its session when the trainer is gone, SIGKILLed included, and removes what it left in
/dev/shm and the temporary folder. Inside the trainer, started engines are shut down at exit and on SIGTERM
and SIGINT (`rollout/engine_registry.py`); the first launch from the main thread installs those handlers.
What another rank knows of an engine, and how a dead one is told: `rollout/engine_record.py`; the
environment it starts with: `rollout/engine_env.py`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from dapo_megatron import backends
from dapo_megatron.backends import engine_threads
from dapo_megatron.backends.base import Backend, EngineArgs
from dapo_megatron.rollout import engine_auth, engine_guard, sglang_models
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine_control import EngineControl
from dapo_megatron.rollout.engine_env import inherited_environment
from dapo_megatron.rollout.engine_record import (
    LOG_TAIL_LINES,
    EngineError,
    EngineRecord,
    process_running,
    read_log_tail,
)
from dapo_megatron.rollout.engine_registry import LIVE_ENGINES, install_handlers_once

_TERM_GRACE_S = 2 * engine_guard.GRACE_S + 5.0  # the guard's grace for SGLang's launcher, then its SIGKILLs
_READY_POLL_S = 0.05  # between tries while a server starts: a refused connection costs microseconds


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (another process may still take it before SGLang binds)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (127.0.0.1 for a local one): where a peer there can reach
    us. Connecting a UDP socket sends nothing; it only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


class SGLangEngine(EngineControl):
    """One SGLang HTTP server started as a subprocess tree.

    Args:
        model_path: Hugging Face model directory (config, tokenizer, weights) the server loads.
        cfg: rollout settings; uses dtype, engine_tp_size, mem_fraction_static, max_total_tokens, seed,
            deterministic, quantization, startup_timeout_s.
        log_file: where the server's stdout and stderr go; its tail is quoted in every EngineError.
        host, port: where the server listens; `port=None` picks a free one. Keep the loopback default unless
            a client on another node must reach the server.
        backend: the device's (`backends/`); None: this machine's.
        base_gpu_id: first GPU of this engine's tensor-parallel group (CUDA only).
        index: the engine's place among the job's engines, which seeds its sampler apart from theirs
            (`RolloutConfig.engine_seed`).
        extra_args: further `sglang.launch_server` flags, appended verbatim.
    """

    def __init__(
        self,
        model_path: str | Path,
        cfg: RolloutConfig,
        *,
        log_file: str | Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        backend: Backend | None = None,
        base_gpu_id: int = 0,
        index: int = 0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.model_path = Path(model_path)
        self.cfg = cfg
        self.log_file = Path(log_file)
        super().__init__(host, port if port is not None else free_port(host))
        self.backend = backend or backends.detect()
        self.base_gpu_id = base_gpu_id
        self.index = index
        self.extra_args = list(extra_args)
        self.backend.check_engine(self.args, cfg.kv_shortfall())
        # The intra-op thread count a launched engine follows while it runs, where the backend has it
        # follow one (`Backend.engine_follows_thread_count`, backends/engine_threads.py).
        self.threads_file: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._tree: list[psutil.Process] = []  # leader and descendants, snapshot when healthy
        self._workers: list[tuple[psutil.Process, str]] = []
        self.api_key = engine_auth.new_key()
        """Every request but a health check needs it (`rollout/engine_auth.py`); registered at launch."""
        self.tmpdir: Path | None = None
        """The server's TMPDIR while it runs."""
        self._launched_at = 0.0  # time.time() at launch

    # ------------------------------------------------------------------ launch

    @property
    def pid(self) -> int | None:
        """Process id of the server's guard (`rollout/engine_guard.py`), the leader of its session."""
        return self._process.pid if self._process is not None else None

    @property
    def args(self) -> EngineArgs:
        """What the server's command line is made of."""
        cfg = self.cfg
        return EngineArgs(
            model_path=str(self.model_path),
            host=self.host,
            port=self.port,
            seed=cfg.engine_seed(self.index),
            dtype=cfg.dtype,
            tp_size=cfg.engine_tp_size,
            base_gpu_id=self.base_gpu_id,
            mem_fraction_static=cfg.mem_fraction_static,
            max_total_tokens=cfg.max_total_tokens,
            quantization=cfg.quantization,
            deterministic=cfg.deterministic,
            extra_args=tuple(self.extra_args),
        )

    def command(self) -> list[str]:
        """The server command line (`python -m MODULE ARGS`; the guard adds the API key inside the server)."""
        return self.backend.engine_command(self.args)

    def _environment(self) -> dict[str, str]:
        env = inherited_environment(os.environ)
        # SGLang finds the model's class here first instead of importing all of its model modules
        # (`rollout/sglang_models`); a package the user names wins.
        env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", sglang_models.__name__)
        self.backend.engine_environment(env)
        if self.threads_file is not None:
            env[engine_threads.THREADS_FILE_ENV] = str(self.threads_file)
        return env

    @property
    def start_threads(self) -> int:
        """The intra-op threads an engine that follows a thread count starts with (its OMP_NUM_THREADS)."""
        return int(self._environment().get("OMP_NUM_THREADS", 1))

    def set_cpu_threads(self, threads: int) -> None:
        """A launched CPU engine computes on `threads` intra-op threads from its next forward pass on."""
        if self.threads_file is None:
            raise EngineError(
                f"engine at {self.url} ({self.backend.name}) is not a launched CPU engine: only those "
                "follow a thread count"
            )
        engine_threads.request_threads(self.threads_file, threads)

    def start(self) -> SGLangEngine:
        """Launch the server and wait until it generates; on failure kill it and raise EngineError."""
        self.launch()
        return self.wait_until_ready()

    def launch(self) -> SGLangEngine:
        """Start the server process and return at once: its start-up (imports, model load) then overlaps with
        whatever the caller does before `wait_until_ready`."""
        if self._process is not None:
            raise EngineError(f"engine at {self.url} was already started")
        if _port_in_use(self.host, self.port):
            # Otherwise the health check could succeed against whatever already listens there.
            raise EngineError(f"port {self.port} on {self.host} is already in use")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        install_handlers_once()
        if self.backend.engine_follows_thread_count:
            # Beside the log, not in /tmp: an engine killed before `shutdown` leaves its few bytes in the
            # run's own directory. A CPU engine's log directory is local, and the engine reads the file per
            # forward.
            fd, name = tempfile.mkstemp(
                prefix=f"{self.log_file.name}.", suffix=".threads", dir=self.log_file.parent
            )
            os.close(fd)
            self.threads_file = Path(name)
            engine_threads.request_threads(self.threads_file, self.start_threads)
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"dapo-engine-{self.port}-"))
        self._launched_at = time.time()
        engine_auth.register(self.url, self.api_key)
        with open(self.log_file, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                self.guarded_command(),
                stdout=log,  # the guard's own complaints; it copies the server's output, key removed
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self._environment(), engine_guard.API_KEY_ENV: self.api_key},
                start_new_session=True,  # its own session and process group: killpg reaches every process
            )
        LIVE_ENGINES.add(self)
        return self

    def guarded_command(self) -> list[str]:
        """`command()` under the guard (`rollout/engine_guard.py`); needs the temporary folder of `launch`."""
        python, flag, *server = self.command()
        assert flag == "-m" and self.tmpdir is not None, "launch() makes the temporary folder"
        return [
            python,
            "-m",
            engine_guard.__name__,
            "--parent",
            str(os.getpid()),
            "--log",
            str(self.log_file),
            "--tmpdir",
            str(self.tmpdir),
            *(["--stop-by-kill"] if self.backend.engine_stop_by_kill else []),
            "--",
            *server,
        ]

    def wait_until_ready(self) -> SGLangEngine:
        """Wait until the launched server generates; on failure (exit, startup_timeout_s) kill it and raise
        EngineError."""
        try:
            self._wait_until_healthy()
        except BaseException:
            self.shutdown()
            raise
        self._tree = self._snapshot_tree()
        self._workers = self._snapshot_workers()
        return self

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            code = self._process.poll() if self._process is not None else None
            if code is not None:
                raise self._error(f"the SGLang engine exited with code {code} while starting")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._error(
                    f"the SGLang engine did not become healthy within {self.cfg.startup_timeout_s:g} s"
                )
            if self.generates(timeout=min(remaining, 30.0)):
                return
            time.sleep(min(_READY_POLL_S, max(remaining, 0.0)))

    def _snapshot_tree(self) -> list[psutil.Process]:
        try:
            leader = psutil.Process(self._process.pid)  # type: ignore[union-attr]
            return [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _snapshot_workers(self) -> list[tuple[psutil.Process, str]]:
        """SGLang's scheduler and detokenizer processes, with their names (a dead one cannot be asked)."""
        workers = []
        for process in self._tree[1:]:
            try:
                name = process.name()
            except psutil.NoSuchProcess:
                continue
            if name.startswith("sglang::"):
                workers.append((process, name))
        return workers

    # ------------------------------------------------------------------ liveness

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def check_alive(self) -> None:
        """Raise EngineError with the log tail unless the server process is running.

        Call it when a request to the engine fails: "the engine died" plus its log explains far more
        than a connection error does."""
        if self._process is None:
            raise EngineError(f"the SGLang engine at {self.url} is not running (not started, or shut down)")
        code = self._process.poll()
        if code is not None:
            raise self._error(f"the SGLang engine died (exit code {code})")
        # A killed scheduler (what an OOM killer picks) takes the launcher down only seconds later, and the
        # HTTP server drops its connections in between; the dead worker is the real news.
        for worker, name in self._workers:
            if not process_running(worker):
                raise self._error(f"the SGLang engine died ({name}, pid {worker.pid}, is gone)")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return read_log_tail(self.log_file, lines)

    def record(self) -> EngineRecord:
        """What another rank needs to address this running engine and to explain its death."""
        processes = [self._tree[0], *(worker for worker, _ in self._workers)] if self._tree else []
        return EngineRecord(
            url=self.url,
            log_file=str(self.log_file),
            host=socket.gethostname(),
            processes=tuple((p.pid, p.create_time()) for p in processes),
            api_key=self.api_key,
        )

    def _error(self, what: str) -> EngineError:
        return EngineError(f"{what}; {self.url}, log {self.log_file}, last lines:\n{self.log_tail()}")

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the server and everything it spawned. Idempotent; safe when the server already died.

        SIGTERM goes to the guard, which passes it to SGLang's launcher for a graceful shutdown, or SIGKILLs
        the server at once where the backend says so (`engine_stop_by_kill`: a CPU engine holds no device
        memory). The guard then kills what is left of the
        session and removes the server's shared memory and temporary files. Should the guard not finish in
        time, everything left is SIGKILLed here: the process group, then every process seen in the tree when
        the server became healthy (in case one left the group).
        """
        process, self._process = self._process, None
        LIVE_ENGINES.discard(self)
        if self.threads_file is not None:
            self.threads_file.unlink(missing_ok=True)
            self.threads_file = None
        if process is None:
            return
        engine_auth.forget(self.url)
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=_TERM_GRACE_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        for child in self._tree:
            with contextlib.suppress(psutil.Error):
                child.kill()
        # Reap the guard so it does not linger as a zombie; bounded, so that a guard the kernel cannot take
        # down at once leaves a zombie behind rather than a trainer that never exits.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=_TERM_GRACE_S)
        _wait_until_exited(self._tree, timeout=_TERM_GRACE_S)
        self._tree, self._workers = [], []
        if process.returncode is None or process.returncode < 0:  # the guard was killed before its clean-up
            engine_guard.remove_slot_files(engine_guard.abandoned_slot_files(self._launched_at))
        if self.tmpdir is not None:  # the guard's job, unless it was killed
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        self.close()

    def __enter__(self) -> SGLangEngine:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url}, pid={self.pid}, device={self.backend.name})"


def _wait_until_exited(processes: Sequence[psutil.Process], *, timeout: float) -> None:
    """Until every one of `processes` has exited, a zombie included: its memory and files are released
    already, and its reaping is up to whoever adopted it (init, which may take seconds to get to it)."""
    deadline = time.monotonic() + timeout
    while any(process_running(process) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.02)
