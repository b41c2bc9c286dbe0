"""The console scripts pyproject.toml declares, as installed (tools/setup_env.sh installs the package): each
one's `--help`, one of them run as the shell runs it, and the runtime dependencies declared against what the
package imports."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import dapo_megatron
from tests.conftest import REPO

SCRIPTS = {
    "dapo-train": "dapo_megatron.train:main",
    "dapo-eval": "dapo_megatron.commands.eval:main",
    "dapo-convert-hf-to-megatron": "dapo_megatron.commands.convert_hf_to_megatron:main",
    "dapo-convert-megatron-to-hf": "dapo_megatron.commands.convert_megatron_to_hf:main",
    "dapo-plan-memory": "dapo_megatron.commands.plan_memory:main",
    "dapo-prepare-data": "dapo_megatron.commands.prepare_data:main",
}

# Imported but not required: installed apart from the package (SGLang: see pyproject.toml), only on GPUs
# (Transformer Engine), or an extra (wandb).
NOT_REQUIRED = {"sglang", "transformer_engine", "wandb"}
DISTRIBUTION_OF = {"megatron": "megatron-core", "hydra": "hydra-core", "huggingface_hub": "huggingface-hub"}


def installed_scripts() -> dict[str, importlib.metadata.EntryPoint]:
    return {
        entry.name: entry
        for entry in importlib.metadata.entry_points(group="console_scripts")
        if entry.value.startswith("dapo_megatron")
    }


def test_every_console_script_is_installed_and_answers_help(capsys: pytest.CaptureFixture[str]) -> None:
    scripts = installed_scripts()
    assert {name: entry.value for name, entry in scripts.items()} == SCRIPTS, (
        "reinstall the package (bash tools/setup_env.sh, or pip install --no-deps -e .)"
    )
    for name, entry in scripts.items():
        main = entry.load()
        try:
            code = main(["--help"])
        except SystemExit as exit_:  # argparse ends --help this way
            code = exit_.code
        out = capsys.readouterr().out
        assert code == 0, name
        assert "usage:" in out and len(out.splitlines()) > 5, f"{name} --help printed {out!r}"


def test_a_console_script_runs_from_the_shell_with_the_trainers_error_convention(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("dapo-train")
    run = subprocess.run(
        [str(script), "trainer.totl_steps=5"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert (run.returncode, run.stderr) == (
        2,
        "error: unknown config key trainer.totl_steps; did you mean trainer.total_steps?\n",
    )


def test_the_tool_scripts_of_a_checkout_run_the_same_commands() -> None:
    for name, target in SCRIPTS.items():
        module = target.split(":")[0].rpartition(".")[2]
        if module == "train":
            continue
        wrapper = (REPO / "tools" / f"{module}.py").read_text()
        assert f"from {target.split(':')[0]} import main" in wrapper, f"tools/{module}.py does not run {name}"


def test_every_third_party_package_the_package_imports_is_a_declared_dependency() -> None:
    imported: set[str] = set()
    for path in Path(dapo_megatron.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"dapo_megatron"} - NOT_REQUIRED
    declared = {
        canonicalize_name(requirement.name)
        for requirement in map(Requirement, importlib.metadata.requires("dapo_megatron") or [])
        if requirement.marker is None  # extras are optional
    }
    missing = {
        name for name in third_party if canonicalize_name(DISTRIBUTION_OF.get(name, name)) not in declared
    }
    assert not missing, f"imported but not declared in pyproject.toml's dependencies: {sorted(missing)}"
