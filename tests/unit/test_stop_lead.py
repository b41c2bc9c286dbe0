"""Each Slurm recipe's stop signal comes at least the plan's stop lead before the time limit: the rest of a
step's update, the checkpoint and the weight sync must fit between `#SBATCH --signal=B:USR1@N` and the limit
(`planning/stop.py`), else the job is killed mid-save and loses the steps since its last checkpoint."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from dapo_megatron import config as C
from dapo_megatron.planning.checkpoint import plan_checkpoint
from dapo_megatron.planning.memory import plan_memory
from dapo_megatron.planning.stop import plan_stop_lead
from tests.conftest import REPO

RECIPES = sorted((REPO / "slurm").glob("*.sbatch"))


def signal_lead_s(sbatch: Path) -> int:
    leads = re.findall(r"^#SBATCH --signal=B:USR1@(\d+)\s*$", sbatch.read_text(), flags=re.MULTILINE)
    assert len(leads) == 1, f"{sbatch.name}: expected one '#SBATCH --signal=B:USR1@N' line, found {leads}"
    return int(leads[0])


def test_every_cluster_recipe_has_a_slurm_script() -> None:
    assert {path.stem for path in RECIPES} >= {"dapo_qwen2.5_0.5b", "dapo_qwen2.5_7b", "dapo_qwen2.5_32b"}


@pytest.mark.parametrize("sbatch", RECIPES, ids=lambda path: path.stem)
def test_the_stop_signal_leaves_the_planned_lead(sbatch: Path) -> None:
    job = C.to_job_config(C.compose([f"experiment={sbatch.stem}"]))
    lead = math.ceil(plan_stop_lead(job, plan_memory(job), plan_checkpoint(job)).lead_s)
    given = signal_lead_s(sbatch)
    assert given >= lead, (
        f"{sbatch.name}: '#SBATCH --signal=B:USR1@{given}' leaves {given} s, the plan's stop lead is "
        f"{lead} s (python tools/plan_memory.py experiment={sbatch.stem}): set N to at least {lead}"
    )
