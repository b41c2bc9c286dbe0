"""Shared test helpers: launching real multi-process (gloo) jobs the way users do, with torchrun."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
DATA_DIRS_ENV = "DAPO_TEST_DATA_DIRS"


def data_dirs() -> list[Path]:
    """Where tests look for the real data samples, in order: `data/`, where tools/prepare_data.py's usage puts
    them, then `../shared/data` beside the clone. DAPO_TEST_DATA_DIRS (paths joined by os.pathsep; empty:
    none) replaces both."""
    listed = os.environ.get(DATA_DIRS_ENV)
    if listed is None:
        return [REPO / "data", REPO.parent / "shared" / "data"]
    return [Path(entry) for entry in listed.split(os.pathsep) if entry]


def real_data(*names: str) -> Path:
    """The first of the files `names` found in data_dirs() (directories first, then names); the calling test
    is skipped, saying where it looked and how to get the files, when none is there."""
    folders = data_dirs()
    for folder in folders:
        for name in names:
            if (folder / name).is_file():
                return folder / name
    pytest.skip(
        f"the real data file {' or '.join(names)} is in none of [{', '.join(map(str, folders))}] "
        "(`python tools/prepare_data.py --output-dir data` writes aime_2024, dapo_math_17k, gsm8k_train and "
        f"gsm8k_test there; {DATA_DIRS_ENV} names other directories)"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_script(path: Path) -> ModuleType:
    """A script (tools/*.py, bench/*.py) as a module; its folder is on the path while it loads, so the
    top-level imports of its neighbours (bench/trainer_runs) resolve."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is being built
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def load_bench_script(stem: str) -> ModuleType:
    """bench/STEM.py as a module (bench/ is not a package: its scripts run as files)."""
    return load_script(REPO / "bench" / f"{stem}.py")


class JsonHandler(BaseHTTPRequestHandler):
    """Base of the tests' stand-in HTTP servers (transport behaviour, recorded requests): JSON replies, no
    log."""

    def reply_json(self, answer: object) -> None:
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def local_http_server(handler: type[BaseHTTPRequestHandler], **state: Any) -> Iterator[ThreadingHTTPServer]:
    """`handler` served on a free loopback port in a thread; `state` becomes attributes of the server."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in state.items():
        setattr(httpd, name, value)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def one_gloo_rank(store: Path) -> Iterator[Any]:
    """This process as the only rank of a gloo job, with megatron-core's groups; yields the ParallelLayout. A
    file store, not a port: other test processes may share the machine."""
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield initialize(ParallelConfig(), seed=0)
    finally:
        shutdown()


def tiny_policy(layout: Any, *, vocab_size: int) -> tuple[torch.nn.Module, Any]:
    """A random 2-layer Qwen2 (megatron-core local layers, fp32) wrapped for training; and its ModelConfig."""
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.trainer.optimizer import wrap_for_training
    from tests.model_configs import small_model_config

    cfg = small_model_config(
        vocab_size=vocab_size,
        max_position_embeddings=256,
        params_dtype="float32",
        transformer_impl="local",
    )
    return wrap_for_training(build_gpt_model(cfg, ParallelConfig(), layout), ParallelConfig()), cfg


def torchrun(
    script: Path | str, nproc: int, *args: str, timeout: float = 300, nodes: int = 1
) -> subprocess.CompletedProcess:
    """Run `script` under torchrun with `nproc` CPU processes per node; fail the test with the job's output.

    `nodes` > 1 starts one torchrun per node on this machine (`--nnodes`, `--node-rank`, static rendezvous, as
    slurm/launch.sh does): the ranks see different node indices, so the paths between nodes run."""
    # The checkout under test, whatever checkout the environment's editable install points at.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=pythonpath)
    port = free_port()
    launchers = []
    for node in range(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--nnodes",
            str(nodes),
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(script),
            *args,
        ]
        launchers.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    try:
        for launcher in launchers:
            stdout, stderr = launcher.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr))
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
    for node, proc in enumerate(results):
        if proc.returncode != 0:
            pytest.fail(
                f"torchrun {script} {' '.join(args)} failed on node {node} (exit {proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            )
    return results[0]


def tiny_qwen2(
    out_dir: Path,
    *,
    vocab_size: int,
    num_layers: int,
    tied: bool = False,
    max_positions: int = 128,
    seed: int = 0,
    **config: object,
) -> torch.nn.Module:
    """A small random transformers Qwen2 (GQA 4/2, QKV bias) saved to `out_dir`. HF initialises biases and
    norms to constants; they are randomised so that a mix-up of them shows in the outputs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            tie_word_embeddings=tied,
            **config,
        )
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out_dir)
    return model


def assert_import_is_light(module: str, heavy: tuple[str, ...]) -> None:
    """Importing `module` in a fresh interpreter loads none of the `heavy` top-level packages."""
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})\n"
        "print(bad)\nsys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, (
        f"importing {module} loaded {result.stdout.strip()} {result.stderr[-2000:]}"
    )
