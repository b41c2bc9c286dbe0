"""The device backends: every device decision lives in them, each backend answers everything the base class
asks, `detect()` agrees with torch, and the CPU one is found without importing torch."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from dapo_megatron import backends
from dapo_megatron.backends.base import Backend, EngineArgs
from dapo_megatron.backends.cpu import SGLANG_CPU
from tests.conftest import REPO

PACKAGE = REPO / "dapo_megatron"
DEVICE_CHECK = re.compile(r"torch\.cuda\b|\.type\s*[!=]=|device\s*[!=]=\s*[\"']|[\"']cuda[\"']\s*(if|else)\b")
"""What a module outside `backends/` would write to decide by the device itself."""
ARGS = EngineArgs(
    model_path="/m",
    host="127.0.0.1",
    port=30000,
    seed=7,
    dtype="auto",
    tp_size=1,
    base_gpu_id=0,
    mem_fraction_static=0.7,
    max_total_tokens=4096,
    quantization=None,
    deterministic=False,
)


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(number, line without its comment) of every line of `path` outside its docstrings."""
    text = path.read_text()
    prose = {
        number
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for number in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    return [(n, line.split("#")[0]) for n, line in enumerate(text.splitlines(), 1) if n not in prose]


def test_no_module_outside_the_backends_tests_the_device() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "backends" not in path.relative_to(PACKAGE).parts
        for number, line in code_lines(path)
        if DEVICE_CHECK.search(line)
    ]
    assert not found, "ask the device backend (dapo_megatron/backends) instead:\n" + "\n".join(found)


def test_the_scan_sees_a_device_check() -> None:
    assert DEVICE_CHECK.search('if tensor.device.type == "cpu":')
    assert DEVICE_CHECK.search("torch.cuda.empty_cache()")
    assert not DEVICE_CHECK.search("backend.empty_cache()")


@pytest.mark.parametrize("backend", [backends.CPU, backends.CUDA], ids=lambda b: b.name)
def test_each_backend_answers_every_question_of_the_base(backend: Backend) -> None:
    declared = [
        name
        for name, hint in typing.get_type_hints(Backend).items()
        if str(hint).startswith("typing.ClassVar")
    ]
    assert declared and all(hasattr(type(backend), name) for name in declared), declared
    for method in ("check_engine", "engine_command", "start", "bucket_buffer"):  # no default in the base
        assert getattr(type(backend), method) is not getattr(Backend, method), method


def test_the_backends_command_lines() -> None:
    cpu, cuda = backends.CPU.engine_command(ARGS), backends.CUDA.engine_command(ARGS)
    assert cpu[:3] == [sys.executable, "-m", SGLANG_CPU] and importlib.util.find_spec(SGLANG_CPU)
    assert cuda[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for command in (cpu, cuda):
        assert command[command.index("--random-seed") + 1] == "7" and "--model-path" in command
    assert "--enable-memory-saver" in cuda and "--enable-memory-saver" not in cpu
    assert cpu[cpu.index("--dtype") + 1] == "float32" and cuda[cuda.index("--dtype") + 1] == "auto"


def test_the_cpu_backend_refuses_what_only_a_gpu_serves() -> None:
    for change, field in [({"tp_size": 2}, "engine_tp_size"), ({"quantization": "fp8"}, "quantization")]:
        args = EngineArgs(**{**ARGS.__dict__, **change})
        with pytest.raises(ValueError, match=rf"rollout\.{field}"):
            backends.CPU.check_engine(args, kv_shortfall=None)
        backends.CUDA.check_engine(args, kv_shortfall=None)
    with pytest.raises(RuntimeError, match=r"model\.transformer_impl=local"):
        backends.CPU.check_transformer_engine()


def test_detect_agrees_with_torch() -> None:
    assert backends.detect() is (backends.CUDA if torch.cuda.is_available() else backends.CPU)
    assert backends.of(torch.zeros(1).device) is backends.CPU
    with pytest.raises(ValueError, match="choose cpu or cuda"):
        backends.named("xpu")


def test_a_visible_gpu_that_torch_cannot_use_is_not_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A driver that lists a GPU sends detection to torch, which has the last word."""
    (tmp_path / "0000:00:01.0").mkdir()
    monkeypatch.setattr(backends, "NVIDIA_GPUS", tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.detect() is backends.CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.detect() is backends.CUDA
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert backends.detect() is backends.CPU  # every GPU hidden


def test_the_cpu_backend_is_found_without_torch() -> None:
    code = (
        "import sys\n"
        "from dapo_megatron import backends\n"
        "backends.NVIDIA_GPUS = backends.Path('/nonexistent')\n"
        "print(backends.detect().name, backends.CPU.engine_command(backends.base.EngineArgs("
        "'/m', 'h', 1, None, 'auto', 1, 0, 0.5, 64, None, False))[2], 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.split() == ["cpu", SGLANG_CPU, "False"], done.stderr
