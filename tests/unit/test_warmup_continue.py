"""A warm-up continues an earlier base (`model.hf_dir`) from its weights, on its own task and split only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_megatron import config as job_config
from dapo_megatron.models.hf_io import load_hf_state
from dapo_megatron.trainer.warmup import earlier_warmup
from tests.conftest import REPO

SHORT = ["warmup.eval_every=1", "warmup.eval_size=4", "warmup.batch_size=8", "warmup.micro_batch_size=8"]


def make_base(out: Path, *overrides: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_demo_base.py"), "--output", str(out), *SHORT, *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )
    return proc


def write_summary(base: Path, **fields: object) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    (base / "warmup_summary.json").write_text(json.dumps({"steps": 5, "seed": 1234, **fields}))
    return base


@pytest.mark.slow
def test_a_continued_warmup_starts_from_the_earlier_weights(tmp_path: Path) -> None:
    first = make_base(tmp_path / "first", "warmup.max_steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # One more step at a negligible lr (Adam's first step moves every weight by about lr): the continued
    # base is the first one if, and only if, the warm-up loaded it. Not loaded, it would be the seeded
    # initial weights, which the first base's two steps moved by ~2 x lr 3e-3.
    second = make_base(
        tmp_path / "second", "warmup.max_steps=1", "warmup.lr=1e-9", f"model.hf_dir={tmp_path / 'first'}"
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "continuing the warm-up" in second.stdout
    before, after = load_hf_state(tmp_path / "first"), load_hf_state(tmp_path / "second")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-6, rtol=0, msg=name)
    summary = json.loads((tmp_path / "second" / "warmup_summary.json").read_text())
    assert summary["steps"] == 3 and summary["continued"]["steps"] == 2


def test_a_warmup_refuses_to_overwrite_the_base_it_continues(tmp_path: Path) -> None:
    base = write_summary(tmp_path / "base", task="addition", task_seed=1234)
    proc = make_base(base, "--force", f"model.hf_dir={base}")
    assert proc.returncode != 0 and "is the base this warm-up continues" in proc.stderr
    assert (base / "warmup_summary.json").exists()  # nothing deleted


def test_the_refusal_sees_a_base_set_by_a_config(tmp_path: Path) -> None:
    # experiment=demo continues outputs/demo_base (relative: here, under tmp_path, never the repository's).
    base = write_summary(tmp_path / "outputs" / "demo_base", task="addition", task_seed=1234)
    proc = make_base(Path("outputs/demo_base"), "--force", "experiment=demo", cwd=tmp_path)
    assert proc.returncode != 0 and "is the base this warm-up continues" in proc.stderr, proc.stderr[-2000:]
    assert (base / "warmup_summary.json").exists()


@pytest.mark.parametrize(
    ("built", "message"),
    [
        ({"task": "column_addition", "task_seed": 1234}, "data.task=column_addition"),
        ({"task": "addition", "task_seed": 7}, "data.task_seed=7"),
    ],
)
def test_a_warmup_refuses_a_base_of_another_task_or_split(tmp_path: Path, built: dict, message: str) -> None:
    base = write_summary(tmp_path / "base", **built)
    job = job_config.load([f"model.hf_dir={base}"], world_size=1)
    with pytest.raises(ValueError, match=message):
        earlier_warmup(job)
    (base / "warmup_summary.json").unlink()
    with pytest.raises(ValueError, match=r"no warmup_summary\.json"):
        earlier_warmup(job)


def test_without_a_base_the_warmup_starts_from_random_weights() -> None:
    assert earlier_warmup(job_config.load([], world_size=1)) == {}
