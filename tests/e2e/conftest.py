"""The demo base every end-to-end test starts from, built once per test run (about a minute on two cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def run(args: list[str], timeout: float, *, warnings: str = "ignore") -> subprocess.CompletedProcess:
    """Run a command from the repository root on one intra-op thread; fail the test with its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS=warnings)
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def demo_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("demo") / "base"
    run([sys.executable, "tools/make_demo_base.py", "--output", str(base)], timeout=900)
    summary = json.loads((base / "warmup_summary.json").read_text())
    assert 0.15 <= summary["greedy_eval_accuracy"] < 0.3, summary
    return base
