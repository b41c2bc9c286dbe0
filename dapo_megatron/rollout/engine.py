"""Lifecycle of one SGLang server process tree: launch, health, memory release/resume, shutdown.

One `SGLangEngine` is one HTTP server (on GPU: one per rollout tensor-parallel group). The trainer
talks to it over HTTP only, so the engine runs in its own process group and never shares CUDA or
Python state with the trainer.

On CPU the server is started through `dapo_megatron.rollout.sglang_cpu` (import-time stand-ins for
SGLang's CUDA-only dependencies) with SGLang's native-torch backends. On CUDA it is plain
`python -m sglang.launch_server` with `--enable-memory-saver`, so that `release_memory` can free the
weights and KV cache while megatron trains; that path cannot be exercised on the CPU CI machine.

Every engine is started through `rollout/engine_guard.py`, which gives it a per-engine API key without
putting the key on a command line or in the log (`rollout/engine_auth.py` sends it with every request), a
temporary folder of its own, and the guarantee that it does not outlive the trainer: the guard stops the
server and everything in its session when the trainer is gone, SIGKILLed included, and removes what it left in
/dev/shm and the temporary folder. Inside the trainer, started engines are shut down at exit (`atexit`) and on
SIGTERM (what Slurm, torchrun and `kill` send) and SIGINT, before the previous handler runs: the first launch
from the main thread installs those handlers (`install_signal_handlers`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import requests

from dapo_megatron.rollout import (
    cpu_weight_loader,
    engine_auth,
    engine_guard,
    engine_threads,
    sglang_models,
)
from dapo_megatron.rollout.config import RolloutConfig

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What SGLang can release and resume separately (`sglang/srt/constants.py`)."""

LOG_TAIL_LINES = 40
CPU_ENGINE_THREADS = 1
"""A CPU engine's intra-op threads unless the user set OMP_NUM_THREADS: beside an update more would compete
with the trainer (trainer/cpu_threads.py leaves the engine this many cores, and gives it the rank's share
while the trainer only waits for it)."""
_CONTROL_TIMEOUT_S = 120.0  # release/resume/flush move whole model states; generous but bounded
_TERM_GRACE_S = 2 * engine_guard.GRACE_S + 5.0  # the guard's grace for SGLang's launcher, then its SIGKILLs
_REMOTE_HEALTH_TIMEOUT_S = 10.0
_READY_POLL_S = 0.05  # between tries while a server starts: a refused connection costs microseconds


_LAUNCHER_REASON = (
    "torchrun's / srun's rendezvous: SGLang initialises torch.distributed from the same variables and would "
    "wait forever for the trainer's world size worth of ranks"
)
WITHHELD_VARIABLES: dict[str, str] = {
    **dict.fromkeys(
        (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
            "ROLE_NAME",
            "MASTER_ADDR",
            "MASTER_PORT",
        ),
        _LAUNCHER_REASON,
    ),
    "PYTORCH_CUDA_ALLOC_CONF": (
        "the trainer's allocator settings; with expandable_segments:True torch_memory_saver, which "
        "--enable-memory-saver loads, refuses to start (torch_memory_saver/entrypoint.py, _sanity_checks), "
        "and a CUDA tensor in expandable segments reaches another process only through pidfd_getfd, which "
        "unprivileged containers deny"
    ),
    "PYTORCH_ALLOC_CONF": (
        "the same settings under torch's newer name, which torch_memory_saver does not check"
    ),
    "CUDA_DEVICE_MAX_CONNECTIONS": (
        "megatron's tensor-parallel overlap orders its kernels through one hardware queue (1, set by each "
        "trainer rank: distributed/layout.py); an engine's kernels and NCCL are not to be serialised by it. "
        "SGLang 0.5.23's launch_server sets its own (8, entrypoints/engine.py _set_envs_and_config), so this "
        "keeps the trainer's value from any engine start that does not"
    ),
}
"""Variables of the trainer's environment an engine does not get, each with why; every other one it inherits
(PATH, HF_HOME, CUDA_VISIBLE_DEVICES, NCCL_* and the rest of slurm/env.sh)."""
WITHHELD_PREFIXES = ("TORCHELASTIC_",)
"""torchrun's agent state: the launcher's, as above."""


class EngineError(RuntimeError):
    """The SGLang engine could not start, died, or refused a control request."""


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


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file; reads at most 256 KB from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return "<no log file>"
    return "\n".join(text.splitlines()[-lines:])


class SGLangEngine:
    """One SGLang HTTP server started as a subprocess tree.

    Args:
        model_path: Hugging Face model directory (config, tokenizer, weights) the server loads.
        cfg: rollout settings; uses dtype, engine_tp_size, mem_fraction_static, max_total_tokens, seed,
            deterministic, quantization, startup_timeout_s.
        log_file: where the server's stdout and stderr go; its tail is quoted in every EngineError.
        host, port: where the server listens; `port=None` picks a free one. Keep the loopback default unless
            a client on another node must reach the server.
        device: "cpu" or "cuda".
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
        device: str = "cpu",
        base_gpu_id: int = 0,
        index: int = 0,
        extra_args: Sequence[str] = (),
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda; got {device!r}")
        if device == "cpu" and cfg.engine_tp_size != 1:
            # SGLang's CPU tensor parallelism needs the sgl_kernel CPU build, which the stand-ins replace.
            raise ValueError(f"rollout.engine_tp_size must be 1 on CPU; got {cfg.engine_tp_size}")
        if device == "cpu" and cfg.quantization:
            raise ValueError(
                f"rollout.quantization={cfg.quantization} needs a CUDA GPU; set rollout.quantization=null on "
                "CPU"
            )
        if device == "cpu" and cfg.deterministic:
            raise ValueError(
                "rollout.deterministic=true needs a CUDA GPU: SGLang's deterministic inference runs on "
                "batch-invariant GPU attention kernels and refuses the CPU engine's torch_native "
                "attention, and without it SGLang ignores per-request sampling seeds; set "
                "rollout.deterministic=false on CPU"
            )
        if device == "cpu" and (shortfall := cfg.kv_shortfall()) is not None:
            warnings.warn(shortfall, stacklevel=2)  # on GPUs the memory fraction sizes the cache
        self.model_path = Path(model_path)
        self.cfg = cfg
        self.log_file = Path(log_file)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.device = device
        self.base_gpu_id = base_gpu_id
        self.index = index
        self.extra_args = list(extra_args)
        # A launched CPU engine's intra-op thread count, which it follows while it runs
        # (rollout/engine_threads.py).
        self.threads_file: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._tree: list[psutil.Process] = []  # leader and descendants, snapshot when healthy
        self._workers: list[tuple[psutil.Process, str]] = []
        self.api_key = engine_auth.new_key()
        """Every request but a health check needs it (`rollout/engine_auth.py`); registered at launch."""
        self.tmpdir: Path | None = None
        """The server's TMPDIR while it runs."""
        self._launched_at = 0.0  # time.time() at launch
        self._session = requests.Session()
        self._session.auth = engine_auth.ENGINE_AUTH

    # ------------------------------------------------------------------ launch

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the server's guard (`rollout/engine_guard.py`), the leader of its session."""
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        """The server command line (`python -m MODULE ARGS`; the guard adds the API key inside the server)."""
        seed = self.cfg.engine_seed(self.index)
        common = [
            "--model-path",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *(["--random-seed", str(seed)] if seed is not None else []),
        ]
        if self.device == "cpu":
            dtype = "float32" if self.cfg.dtype == "auto" else self.cfg.dtype
            return [
                sys.executable,
                "-m",
                "dapo_megatron.rollout.sglang_cpu",
                *common,
                "--device",
                "cpu",
                "--attention-backend",
                "torch_native",
                "--sampling-backend",
                "pytorch",
                "--dtype",
                dtype,
                # On CPU the KV cache is sized by max_total_tokens; the fraction only has to let it fit.
                # SGLang checks it as "host memory that vanished while the weights loaded < fraction x free
                # memory before", so whatever a neighbour (another engine starting, a trainer building its
                # model) allocates meanwhile counts as weights, and a small fraction (0.05 of 20 GB free)
                # refuses to start beside a neighbour's ~1 GB. Half tolerates any neighbour that leaves room
                # to run.
                "--mem-fraction-static",
                "0.5",
                "--max-total-tokens",
                str(self.cfg.max_total_tokens),
                "--disable-cuda-graph",
                "--skip-server-warmup",
                # Idle, the scheduler otherwise spins a whole core while the trainer computes on the
                # same cores, and a trainer on more than one thread slows down beside it (see
                # bench/RESULTS.md, 'CPU idle cores'). It polls its sockets instead, so a request still
                # wakes it at once.
                "--sleep-on-idle",
                "--custom-weight-loader",
                cpu_weight_loader.LOAD_FORMAT,
                *self.extra_args,
            ]
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *common,
            "--dtype",
            self.cfg.dtype,
            "--tp-size",
            str(self.cfg.engine_tp_size),
            "--base-gpu-id",
            str(self.base_gpu_id),
            "--mem-fraction-static",
            str(self.cfg.mem_fraction_static),
            "--enable-memory-saver",
            *(["--enable-deterministic-inference"] if self.cfg.deterministic else []),
            *(["--quantization", self.cfg.quantization] if self.cfg.quantization else []),
            *self.extra_args,
        ]

    def _environment(self) -> dict[str, str]:
        # Built on purpose, not inherited wholesale: the trainer's launcher and its device settings are not an
        # engine's (WITHHELD_VARIABLES says why for each).
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in WITHHELD_VARIABLES and not k.startswith(WITHHELD_PREFIXES)
        }
        # SGLang finds the model's class here first instead of importing all of its model modules
        # (`rollout/sglang_models`); a package the user names wins.
        env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", sglang_models.__name__)
        if self.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(CPU_ENGINE_THREADS))
            if self.threads_file is not None:
                env[engine_threads.THREADS_FILE_ENV] = str(self.threads_file)
        return env

    @property
    def start_threads(self) -> int:
        """The intra-op threads a CPU engine starts with (OMP_NUM_THREADS, else CPU_ENGINE_THREADS)."""
        return int(self._environment().get("OMP_NUM_THREADS", CPU_ENGINE_THREADS))

    def set_cpu_threads(self, threads: int) -> None:
        """A launched CPU engine computes on `threads` intra-op threads from its next forward pass on."""
        if self.threads_file is None:
            raise EngineError(
                f"engine at {self.url} ({self.device}) is not a launched CPU engine: only those "
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
        _install_handlers_once()
        if self.device == "cpu":
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
        _LIVE_ENGINES.add(self)
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
            # A CPU engine holds nothing its graceful shutdown would release (no device memory): a kill stops
            # it in well under a second instead of 5-8 (bench/RESULTS.md, 'Engine stop').
            *(["--stop-by-kill"] if self.device == "cpu" else []),
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
            if self._generates(timeout=min(remaining, 30.0)):
                return
            time.sleep(min(_READY_POLL_S, max(remaining, 0.0)))

    def _generates(self, timeout: float) -> bool:
        # A one-token greedy generation: 200 means the scheduler really works. Not /health_generate, which
        # does the same but sleeps a whole second before it looks for the answer. The server listens only
        # once its scheduler is up, so until then each try is a refused connection and costs nothing.
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        try:
            return self._session.post(f"{self.url}/generate", json=body, timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

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
            if not _running(worker):
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

    # ------------------------------------------------------------------ control requests

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float = _CONTROL_TIMEOUT_S,
    ) -> requests.Response:
        try:
            response = self._session.request(method, f"{self.url}{path}", json=body, timeout=timeout)
        except requests.RequestException as err:
            self.check_alive()
            raise EngineError(f"{method} {path} on the SGLang engine at {self.url} failed: {err}") from err
        if response.status_code != 200:
            raise EngineError(
                f"{method} {path} on the SGLang engine at {self.url} returned "
                f"HTTP {response.status_code}: {response.text[:2000]}"
            )
        return response

    def server_info(self) -> dict[str, Any]:
        """SGLang's resolved server arguments plus live scheduler state."""
        return self._request("GET", "/server_info").json()

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free the given parts of the engine's GPU memory (all of them by default) while megatron trains.

        Needs `--enable-memory-saver` (set on CUDA); on CPU SGLang accepts the call and keeps its memory."""
        self._request("POST", "/release_memory_occupation", {"tags": _checked_tags(tags)})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Re-occupy released memory. Resume in stages to keep the peak low: `["weights"]`, then push the
        new weights, then `["kv_cache"]` (and `["cuda_graph"]`) once the trainer's buffers are freed."""
        self._request("POST", "/resume_memory_occupation", {"tags": _checked_tags(tags)})

    def flush_cache(self, wait_s: float = 0.0) -> None:
        """Drop the prefix (radix) cache. SGLang refuses while requests are running; with `wait_s` > 0
        it waits up to that long for them to finish first."""
        self._request("POST", f"/flush_cache?timeout={wait_s:g}", timeout=_CONTROL_TIMEOUT_S + wait_s)

    def update_weight_version(self, version: str) -> None:
        """Label the served weights; every later sample carries it in `weight_version`."""
        self._request("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Stop the server and everything it spawned. Idempotent; safe when the server already died.

        SIGTERM goes to the guard. For a GPU engine it passes it to SGLang's launcher, which shuts down
        gracefully (its watchdog notices within 5 s) and stops its children, whereas a scheduler that is
        signalled directly makes the launcher wait seconds for crash diagnostics; a CPU engine, which holds
        no device memory, is SIGKILLed at once (`--stop-by-kill`). The guard then kills what is left of the
        session and removes the server's shared memory and temporary files. Should the guard not finish in
        time, everything left is SIGKILLed here: the process group, then every process seen in the tree when
        the server became healthy (in case one left the group).
        """
        process, self._process = self._process, None
        _LIVE_ENGINES.discard(self)
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
        self._session.close()

    def __enter__(self) -> SGLangEngine:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url}, pid={self.pid}, device={self.device})"


@dataclass(frozen=True)
class EngineRecord:
    """A running engine as seen from another rank (picklable): the rank that drives rollouts talks to every
    engine, but only the rank that launched one holds its `SGLangEngine`."""

    url: str
    log_file: str
    host: str
    """Hostname of the launching rank."""
    processes: tuple[tuple[int, float], ...]
    """(pid, start time) of the server's guard and SGLang workers; the start time tells a reused pid
    apart."""
    api_key: str | None = field(default=None, repr=False)
    """What every request but a health check needs (`rollout/engine_auth.py`)."""

    def check_alive(self) -> None:
        """Raise EngineError with the log tail when a process of the engine is gone (checked on its own host;
        from another host: when it does not answer its health endpoint)."""
        if self.host == socket.gethostname():
            for pid, started in self.processes:
                if not _running_since(pid, started):
                    raise self._error(f"the SGLang engine died (pid {pid} is gone)")
            return
        try:
            requests.get(f"{self.url}/health", timeout=_REMOTE_HEALTH_TIMEOUT_S).raise_for_status()
        except requests.RequestException as err:
            raise self._error(f"the SGLang engine on {self.host} does not answer ({err})") from err

    def _error(self, what: str) -> EngineError:
        return EngineError(
            f"{what}; {self.url}, log {self.log_file} on {self.host}, last lines:\n"
            f"{read_log_tail(Path(self.log_file))}"
        )


def liveness_check(engines: Sequence[SGLangEngine | EngineRecord]) -> Callable[[str], None]:
    """A `RolloutClient.on_error` hook: given the URL of the engine a request failed on, raise EngineError if
    that engine died, so the failure names the engine and quotes its log instead of a refused connection."""
    by_url = {engine.url.rstrip("/"): engine for engine in engines}

    def check(url: str) -> None:
        engine = by_url.get(url.rstrip("/"))
        if engine is not None:
            engine.check_alive()

    return check


def raise_if_any_died(engines: Sequence[SGLangEngine | EngineRecord], failure: BaseException) -> None:
    """After `failure` of a request to some engine (a weight push, a control call): raise EngineError,
    caused by it, for the first engine that died, so the job names the engine and quotes its log."""
    for engine in engines:
        try:
            engine.check_alive()
        except EngineError as died:
            raise died from failure


def _running_since(pid: int, started: float) -> bool:
    try:
        process = psutil.Process(pid)
        return _running(process) and process.create_time() == started
    except psutil.NoSuchProcess:
        return False


def _wait_until_exited(processes: Sequence[psutil.Process], *, timeout: float) -> None:
    """Until every one of `processes` has exited, a zombie included: its memory and files are released
    already, and its reaping is up to whoever adopted it (init, which may take seconds to get to it)."""
    deadline = time.monotonic() + timeout
    while any(_running(process) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _checked_tags(tags: Sequence[str] | None) -> list[str] | None:
    if tags is None:
        return None
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; choose from {MEMORY_TAGS}")
    return list(tags)


# ---------------------------------------------------------------------- no orphans


class _EngineRegistry:
    """Engines that are started and not yet shut down, for atexit and the signal handlers."""

    def __init__(self) -> None:
        self._engines: set[SGLangEngine] = set()
        # Reentrant: a signal handler runs on the main thread, possibly while that thread holds the lock.
        self._lock = threading.RLock()

    def add(self, engine: SGLangEngine) -> None:
        with self._lock:
            self._engines.add(engine)

    def discard(self, engine: SGLangEngine) -> None:
        with self._lock:
            self._engines.discard(engine)

    def shutdown_all(self) -> None:
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            engine.shutdown()


_LIVE_ENGINES = _EngineRegistry()
atexit.register(_LIVE_ENGINES.shutdown_all)


_handlers_installed = False


def _install_handlers_once() -> None:
    # Python installs handlers from the main thread only; an engine launched elsewhere still has its guard.
    if not _handlers_installed and threading.current_thread() is threading.main_thread():
        install_signal_handlers()


def install_signal_handlers(signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """On each of `signals`, shut down every live engine, then do what the previous handler would have done.

    The first `SGLangEngine.launch` from the main thread calls it (Python only installs signal handlers
    there); call it yourself only to install the handlers earlier. A previous Python handler is called (for
    SIGINT: KeyboardInterrupt, so the caller's clean-up still runs); with the default action the signal is
    re-delivered so the process still dies of it; an ignored signal stays ignored, and stops nothing. A second
    signal while the engines are being shut down acts at once: their guards finish the job when the trainer
    is gone. The trainer's `distributed/stop.StopRequest`, installed later, turns SIGTERM into a request to
    checkpoint and exit at the next step boundary, after which the engines are shut down as usual.
    """
    global _handlers_installed
    _handlers_installed = True
    stopping = threading.Event()
    for signum in signals:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            if not stopping.is_set():
                stopping.set()
                try:
                    _LIVE_ENGINES.shutdown_all()
                finally:
                    stopping.clear()
            if callable(previous):
                previous(signum, frame)
            else:  # the default action; None: a handler not installed from Python, treated alike
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(signum, handler)
