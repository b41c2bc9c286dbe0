"""The package as a wheel (`pip install .`, not editable): it carries the Hydra configs, and an installed copy
finds them, with no checkout anywhere on the way."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

# What pyproject.toml builds from: the package (with its link to configs/), the configs, and the files its
# metadata names.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "configs", "dapo_megatron")


def pip(*args: str, cwd: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "--disable-pip-version-check"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"pip {' '.join(args)}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built offline by the installed setuptools, from a copy of the sources (a build writes build/
    and *.egg-info into the tree it builds)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools, pyproject.toml's build backend, is not installed (the build runs offline)")
    if not any(importlib.util.find_spec(name) for name in ("setuptools.command.bdist_wheel", "wheel")):
        pytest.skip("this setuptools cannot build wheels (before 70.1) and the `wheel` package is missing")
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            skip = shutil.ignore_patterns("__pycache__")
            shutil.copytree(REPO / name, source / name, symlinks=True, ignore=skip)
        else:
            shutil.copy2(REPO / name, source / name)
    pip("wheel", "--no-build-isolation", "--wheel-dir", str(root / "dist"), str(source), cwd=root)
    (built,) = (root / "dist").glob("dapo_megatron-*.whl")
    return built


def test_the_wheel_carries_every_config(wheel: Path) -> None:
    configs = {
        f"dapo_megatron/configs/{path.relative_to(REPO / 'configs').as_posix()}"
        for path in (REPO / "configs").rglob("*.yaml")
    }
    assert len(configs) > 20
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert configs <= shipped, sorted(configs - shipped)


def test_an_installed_wheel_composes_the_job_config_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    pip("install", "--target", str(site), str(wheel), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The installed copy comes first on the path; the environment's editable install (if any) is looked up
    # after it, so the imports below are the wheel's.
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run(
        [sys.executable, "-c", "import dapo_megatron.config as c; print(c.__file__); print(c.CONFIG_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    module, config_dir = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(config_dir) == site / "dapo_megatron" / "configs"
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_megatron.train",
            "--cfg",
            "job",
            "experiment=demo",
            "reward=last_number",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    resolved = yaml.safe_load(job.stdout)
    assert resolved["experiment_name"] == "demo" and resolved["optim"]["lr"] == 3e-4
    assert resolved["reward"]["function"] == "dapo_megatron.rewards.example:last_number_matches"
