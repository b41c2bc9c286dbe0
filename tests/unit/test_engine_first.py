"""A CPU trainer launches its engine before it imports torch (`train.launch_engine_first`): the config, the
preflight checks and the engine's launch are torch-free (the list: tests/unit/test_torch_free.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from dapo_megatron import config as job_config
from dapo_megatron.models.hf_export import export_config
from tests.conftest import REPO

PROBE = textwrap.dedent("""
    import sys
    from dapo_megatron.trainer.fleet import EngineFleet

    def launch(fleet):
        print("LAUNCH", fleet.backend.name, sorted(m for m in sys.modules if m.split(".")[0] == "torch")[:3])
        raise SystemExit(0)

    EngineFleet.launch = launch
    from dapo_megatron.train import main
    main(sys.argv[1:])
    print("NO LAUNCH")
""")


def test_the_cpu_trainer_launches_its_engine_before_it_imports_torch(tmp_path: Path) -> None:
    overrides = ["experiment=demo", f"output_dir={tmp_path / 'run'}"]
    job = job_config.to_job_config(job_config.compose(overrides))
    hf_dir = tmp_path / "base"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(export_config(None, job.model, torch.float32)))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *overrides, f"model.hf_dir={hf_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LAUNCH cpu []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
