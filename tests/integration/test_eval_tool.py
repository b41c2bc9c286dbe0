"""tools/eval.py end to end: a real SGLang engine, DAPO's scorer, avg@k and pass@k."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.sglang


def test_eval_tool_reports_avg_and_pass_at_k(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, "tools/eval.py", "--model", str(tiny_model_dir), "--output-json", str(out),
         "eval.num_problems=6", "eval.samples_per_problem=4", "rollout.max_total_tokens=4096"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads(out.read_text())
    assert "6 problems x 4 samples" in proc.stdout and "avg@4" in proc.stdout
    assert 0.0 <= metrics["eval/accuracy"] <= metrics["eval/pass@4"] <= 1.0
    assert metrics["eval/response_length"] > 0
