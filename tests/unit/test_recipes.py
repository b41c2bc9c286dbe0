"""The paper recipes' data: every file they name is one `dapo-prepare-data` writes, and the 0.5B recipe is
held out on a set where a 0.5B model can show progress."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron.commands.prepare_data import DATASETS
from dapo_megatron.config import compose, to_job_config

PAPER_RECIPES = ["dapo_qwen2.5_0.5b", "dapo_qwen2.5_7b", "dapo_qwen2.5_32b"]
PREPARED = {output.name for outputs in DATASETS.values() for output in outputs}


@pytest.mark.parametrize("experiment", PAPER_RECIPES)
def test_every_data_file_of_a_paper_recipe_is_written_by_prepare_data(experiment: str) -> None:
    data = to_job_config(compose([f"experiment={experiment}"])).data
    for path in map(Path, [*data.train_files, *data.eval_files]):
        assert path.parent == Path("data") and path.stem in PREPARED, f"{path}: not an output of prepare_data"


def test_the_small_recipe_is_held_out_on_gsm8k_not_aime() -> None:
    job = to_job_config(compose(["experiment=dapo_qwen2.5_0.5b"]))
    assert [Path(path).stem for path in job.data.eval_files] == ["gsm8k_test"]
    assert job.eval.num_problems * job.eval.samples_per_problem >= 1000  # enough samples to see a few points
