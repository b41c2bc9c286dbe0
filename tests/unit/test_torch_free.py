"""Which modules must not import torch, as one rule.

A CPU trainer (`python -m dapo_megatron.train`) launches its SGLang engine before it imports torch, so that
torch's import runs beside the engine's start-up (`train.launch_engine_first`); the memory planner
(`dapo-plan-memory`) plans a GPU cluster from the config alone. `TORCH_FREE` lists the modules those paths may
import, and this file checks that:

(a) each of them imports without loading torch;
(b) a CPU trainer loads no other module of the package before it launches its engine, so a new import on
    that path fails here until its module is listed (and torch-free);
(c) an import inside a function appears only in a TORCH_FREE module (its torch code imports torch where it
    runs), in a module that runs in the engine process (`ENGINE_SIDE`), or for a package of `OPTIONAL`.
    Every other import is at its module's top.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dapo_megatron
from dapo_megatron import config as job_config
from dapo_megatron.models.hf_export import export_config
from tests.conftest import REPO

PACKAGE = Path(dapo_megatron.__file__).parent

TORCH_FREE = (
    # The package and its subpackages: importing any module runs them first.
    "dapo_megatron",
    "dapo_megatron.algo",
    "dapo_megatron.commands",
    "dapo_megatron.data",
    "dapo_megatron.distributed",
    "dapo_megatron.models",
    "dapo_megatron.planning",
    "dapo_megatron.rewards",
    "dapo_megatron.rollout",
    "dapo_megatron.trainer",
    # The job's config and its component configs: composed and validated before anything starts.
    "dapo_megatron.config",
    "dapo_megatron.algo.config",
    "dapo_megatron.data.config",
    "dapo_megatron.distributed.config",
    "dapo_megatron.models.config",
    "dapo_megatron.rewards.config",
    "dapo_megatron.rollout.config",
    "dapo_megatron.trainer.config",
    # What the config's checks use.
    "dapo_megatron.data.arithmetic",
    "dapo_megatron.models.fp8",
    "dapo_megatron.models.sequence_padding",
    "dapo_megatron.trainer.placement",
    "dapo_megatron.versions",
    # The reward scorers: the config checks the one it names; spawned reward workers import them afresh.
    "dapo_megatron.rewards.custom",
    "dapo_megatron.rewards.endpoint",
    "dapo_megatron.rewards.math_dapo",
    "dapo_megatron.rewards.pool",
    "dapo_megatron.rewards.registry",
    "dapo_megatron.rewards.symbolic",
    # The trainer's command line up to its engine's launch (train.py's module level and `parse_job`): help,
    # config errors, the preflight checks (checkpoint: its paths, tracker and manifests), the console.
    "dapo_megatron.train",
    "dapo_megatron.cli",
    "dapo_megatron.preflight",
    "dapo_megatron.checkpoint",
    "dapo_megatron.metrics",
    "dapo_megatron.trainer.startup",
    "dapo_megatron.distributed.launch",
    "dapo_megatron.distributed.run_tmpdir",
    # The engine's launch: the fleet, the device backends (found without torch, also by a dry run), the
    # engine launcher and the engine-side modules it names (LOAD_FORMAT, the threads file).
    "dapo_megatron.trainer.fleet",
    "dapo_megatron.backends",
    "dapo_megatron.backends.base",
    "dapo_megatron.backends.cpu",
    "dapo_megatron.backends.cuda",
    "dapo_megatron.backends.cpu_weight_loader",
    "dapo_megatron.backends.engine_threads",
    "dapo_megatron.rollout.engine",
    "dapo_megatron.rollout.engine_auth",
    "dapo_megatron.rollout.engine_control",
    "dapo_megatron.rollout.engine_env",
    "dapo_megatron.rollout.engine_guard",
    "dapo_megatron.rollout.engine_record",
    "dapo_megatron.rollout.engine_registry",
    "dapo_megatron.rollout.sglang_models",
    # The memory planner: `dapo-plan-memory` plans a GPU cluster from the config alone, on any machine (the
    # dry run adds megatron-core's RankGenerator for its table of ranks, imported where it is used).
    "dapo_megatron.commands.plan_memory",
    "dapo_megatron.planning.memory",
    "dapo_megatron.planning.checkpoint",
    "dapo_megatron.planning.stop",
    "dapo_megatron.planning.report",
    "dapo_megatron.flops",
)

ENGINE_SIDE = {
    "dapo_megatron.backends.sglang_cpu": (
        "the CPU engine's entry point, run in the engine process: it installs import-time stand-ins before "
        "SGLang is imported, so its imports come in a deliberate order inside its functions"
    ),
}
"""Modules whose function-level imports are deliberate, with the reason."""

OPTIONAL = {
    "sglang": (
        "the engine is another process; the trainer reuses two pieces of SGLang (the GPU weight-sync group's "
        "set-up, the flattened bucket's metadata type) only on the paths that need them, so a CPU trainer "
        "never imports it (~3-5 s; test_weight_sync_buckets.py)"
    ),
    "wandb": "an optional extra (pyproject's [wandb]), imported only when trainer.loggers names it (~0.7 s)",
    "sympy": (
        "~0.25 s, needed only by the math scorer's symbolic fallback in the reward workers, which are "
        "spawned and pay for every import (test_rewards_pool.py keeps it out of dapo_megatron.rewards)"
    ),
}
"""Third-party packages imported inside the functions that use them, with the reason."""


# ------------------------------------------------------------------------------------- (a) imported alone

FIRST_TO_LOAD_TORCH = textwrap.dedent("""
    import importlib, sys, traceback

    class Witness:
        # Records where torch was first imported from, and leaves the import to the real finders.
        where = None

        def find_spec(self, name, path=None, target=None):
            if name == "torch" and Witness.where is None:
                frames = [f for f in traceback.extract_stack() if "importlib" not in f.filename]
                Witness.where = f"{frames[-2].filename}:{frames[-2].lineno}" if len(frames) > 1 else "?"
            return None

    sys.meta_path.insert(0, Witness())
    for name in sys.argv[1:]:
        importlib.import_module(name)
        if "torch" in sys.modules:
            print(name, Witness.where)
            break
""")


def first_to_load_torch(modules: list[str], extra_path: list[Path] | None = None) -> str | None:
    """The first of `modules`, imported one after another in a fresh interpreter, after whose import torch
    is loaded, with the line that imported it; None when none loads it."""
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", FIRST_TO_LOAD_TORCH, *modules],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip() or None


def test_every_torch_free_module_imports_without_torch() -> None:
    assert len(set(TORCH_FREE)) == len(TORCH_FREE)
    assert first_to_load_torch(list(TORCH_FREE)) is None


def test_a_module_that_imports_torch_is_caught(tmp_path: Path) -> None:
    (tmp_path / "loads_torch.py").write_text("import json\nimport torch\n")
    found = first_to_load_torch(["dapo_megatron.config", "loads_torch", "dapo_megatron.cli"], [tmp_path])
    assert found == f"loads_torch {tmp_path / 'loads_torch.py'}:2"


# ---------------------------------------------------------------------- (b) the CPU trainer's launch path

PROBE = textwrap.dedent("""
    import json, sys
    from dapo_megatron.trainer.fleet import EngineFleet

    def launch(fleet):
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("dapo_megatron", "torch"))
        print("LAUNCH", fleet.backend.name, json.dumps(loaded))
        raise SystemExit(0)

    EngineFleet.launch = launch
    from dapo_megatron.train import main
    main(sys.argv[1:])
    print("NO LAUNCH")
""")


def test_a_cpu_trainer_loads_only_torch_free_modules_before_its_engine_starts(tmp_path: Path) -> None:
    overrides = ["experiment=demo", f"output_dir={tmp_path / 'run'}"]
    job = job_config.to_job_config(job_config.compose(overrides))
    hf_dir = tmp_path / "base"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(export_config(None, job.model, torch.float32)))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *overrides, f"model.hf_dir={hf_dir}"],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # a CPU trainer, also on a machine with GPUs
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next((line for line in done.stdout.splitlines() if line.startswith("LAUNCH cpu ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-2000:]
    loaded = json.loads(line.removeprefix("LAUNCH cpu "))
    assert [name for name in loaded if name.split(".")[0] == "torch"] == []
    assert "dapo_megatron.rollout.engine" in loaded  # the launcher itself, not a stand-in
    unlisted = sorted(set(loaded) - set(TORCH_FREE))
    assert unlisted == [], f"list these in TORCH_FREE (torch-free), or keep them off the path: {unlisted}"


# ------------------------------------------------------------------------------- (c) function-level imports


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def function_level_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import inside a function (methods and nested functions included);
    relative imports resolved from `package`, the one the module belongs to."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif in_function and isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join([*base, *([module] if module else [])])
                found.append((child.lineno, module))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(source), False)
    return found


def all_function_level_imports() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found[module] = function_level_imports(path.read_text(), package)
    return found


def test_imports_inside_functions_only_where_the_rule_allows_them() -> None:
    misplaced = [
        f"{module.replace('.', '/')}.py:{line} imports {imported}"
        for module, imports in all_function_level_imports().items()
        if module not in TORCH_FREE and module not in ENGINE_SIDE
        for line, imported in imports
        if imported.split(".")[0] not in OPTIONAL
    ]
    assert misplaced == [], "import at the module's top (or see this file's rule):\n" + "\n".join(misplaced)


def test_the_exceptions_are_still_needed() -> None:
    imports = all_function_level_imports()
    deferred = {imported.split(".")[0] for found in imports.values() for _, imported in found}
    assert sorted(set(OPTIONAL) - deferred) == []
    assert [module for module in ENGINE_SIDE if not imports.get(module)] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os\nif os.name:\n    import json\n", []),
        ("def f():\n    import torch\n", [(2, "torch")]),
        ("class A:\n    def f(self):\n        def g():\n            from x.y import z\n", [(4, "x.y")]),
        ("async def f():\n    from . import engine_auth\n", [(2, "dapo_megatron.rollout")]),
        ("def f():\n    from ..backends import base\n", [(2, "dapo_megatron.backends")]),
    ],
)
def test_the_scan_finds_every_import_inside_a_function(source: str, expected: list[tuple[int, str]]) -> None:
    assert function_level_imports(source, "dapo_megatron.rollout") == expected
