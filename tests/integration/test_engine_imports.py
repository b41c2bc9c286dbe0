"""What a CPU engine's processes import, checked in a subprocess set up as the engine's launcher is (the
stand-ins of `backends/sglang_cpu.py`, the environment of `SGLangEngine`): SGLang finds the Qwen2 class
through `rollout/sglang_models` without importing its other model modules, still finds any other
architecture through its own registry, its debug dumper finds no megatron-core to import, and nothing imports
torch's compiler until a function handed to `torch.compile` is first called."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine
from tests.conftest import REPO

pytestmark = pytest.mark.sglang

PROBE = textwrap.dedent("""
    import json, sys
    import dapo_megatron.backends.sglang_cpu
    import sglang.srt.managers.scheduler, sglang.srt.model_executor.model_runner
    import torch
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.debug_utils import dumper
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    qwen2, _ = ModelRegistry.resolve_model_cls(["Qwen2ForCausalLM"])
    report = {
        "qwen2_is_sglangs": qwen2 is Qwen2ForCausalLM,
        "model_modules_before": sorted(m for m in sys.modules if m.startswith("sglang.srt.models.")),
        "megatron_plugin": dumper._MegatronPlugin._available,
        "megatron_loaded": [m for m, v in sys.modules.items() if m.startswith("megatron") and v is not None],
    }
    llama, _ = ModelRegistry.resolve_model_cls(["LlamaForCausalLM"])  # not in the package: SGLang's registry
    report["llama"] = f"{llama.__module__}.{llama.__name__}"
    report["compiler_after_imports"] = "torch._inductor.compile_fx" in sys.modules

    traced = []
    def backend(graph, example_inputs):
        traced.append(len(example_inputs))
        return graph.forward

    @torch.compile(backend=backend, dynamic=False)
    def add_one(x):
        return x + 1

    report["traced_before_call"] = len(traced)
    report["result"] = add_one(torch.ones(3)).tolist()
    report["traced_after_call"] = traced
    report["module_compiled_at_once"] = type(torch.compile(torch.nn.Linear(2, 2), backend=backend)).__name__
    print("RESULT " + json.dumps(report))
""")


def test_the_engine_finds_qwen2_alone_and_imports_neither_megatron_nor_the_compiler(tmp_path) -> None:
    engine = SGLangEngine(REPO, RolloutConfig(), log_file=tmp_path / "engine.log")
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=engine._environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    report = json.loads(line.removeprefix("RESULT "))
    assert report["qwen2_is_sglangs"]
    # SGLang's own registry imports ~270 model modules; the package only Qwen2's (and what it imports).
    assert len(report["model_modules_before"]) < 10, report["model_modules_before"]
    assert report["llama"] == "sglang.srt.models.llama.LlamaForCausalLM"
    assert report["megatron_plugin"] is False and report["megatron_loaded"] == []
    # torch.compile at import time would load the compiler (~0.6 s of the engine's start); a deferred function
    # compiles at its first call, through the backend and options it was given.
    assert report["compiler_after_imports"] is False
    assert report["traced_before_call"] == 0
    assert report["result"] == [2.0, 2.0, 2.0] and report["traced_after_call"] == [1]
    assert report["module_compiled_at_once"] == "OptimizedModule"
