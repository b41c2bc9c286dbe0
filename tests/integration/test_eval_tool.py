"""tools/eval.py end to end: a real SGLang engine, DAPO's scorer, avg@k and pass@k, overall and per data
source of two eval files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.trainer.evaluate import by_source
from tests.conftest import REPO

pytestmark = pytest.mark.sglang


def eval_file(path: Path, data_source: str, sums: list[tuple[int, int]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Solve: {a}+{b}=? ", "answer": str(a + b), "data_source": data_source})
            + "\n"
            for a, b in sums
        )
    )
    return path


def test_eval_tool_reports_avg_and_pass_at_k_per_data_source(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "metrics.json"
    files = [
        eval_file(tmp_path / "aime.jsonl", "aime2024", [(1, 2), (3, 4), (5, 6)]),
        eval_file(tmp_path / "gsm8k.jsonl", "gsm8k", [(7, 8), (9, 10), (11, 12)]),
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "tools/eval.py",
            "--model",
            str(tiny_model_dir),
            "--output-json",
            str(out),
            f"data.eval_files=[{files[0]},{files[1]}]",
            "data.use_chat_template=false",
            "eval.num_problems=6",
            "eval.samples_per_problem=4",
            "rollout.max_total_tokens=4096",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads(out.read_text())
    assert "6 problems x 4 samples" in proc.stdout and "on 1 cpu engine(s): avg@4" in proc.stdout
    sources = by_source(metrics, 4)
    assert sorted(sources) == ["aime2024", "all", "gsm8k"]
    for summary in sources.values():
        assert 0.0 <= summary["avg"] <= summary["pass"] <= 1.0 and summary["response_length"] > 0
    assert sources["all"]["avg"] == pytest.approx(
        (sources["aime2024"]["avg"] + sources["gsm8k"]["avg"]) / 2
    )  # three problems each
    assert "  aime2024: avg@4" in proc.stdout and "  gsm8k: avg@4" in proc.stdout
