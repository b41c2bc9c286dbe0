"""The trainer's command line as a user meets it: `--help`, `--cfg job`, and a mistyped key."""

from __future__ import annotations

import pytest
import yaml

from dapo_megatron.config import CONFIG_DIR
from dapo_megatron.train import main as train_main
from dapo_megatron.trainer.config import TrainerConfig


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = train_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_lists_the_config_groups_their_defaults_and_the_common_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    lines = out.splitlines()
    groups = {line.split()[0]: line for line in lines if line.startswith("  ") and line.split()[0].isalpha()}
    for group in (path.name for path in CONFIG_DIR.iterdir() if path.is_dir()):
        assert group in groups, f"config group {group} missing from --help"
    assert "adamw*" in groups["optim"] and "adamw_demo" in groups["optim"]
    assert "tiny*" in groups["model"] and "qwen2.5-7b" in groups["model"]
    assert "demo" in out.split("experiment", 1)[1].split("model", 1)[0]
    total_steps = next(line for line in lines if line.lstrip().startswith("trainer.total_steps "))
    assert total_steps.endswith(f"[{TrainerConfig().total_steps}]")
    assert "optim.lr" in out and "[1.0e-06]" in out and "--cfg job" in out


def test_cfg_job_prints_the_resolved_config_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--cfg", "job", "experiment=demo", "trainer.total_steps=7"], capsys)
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["trainer"]["total_steps"] == 7
    assert printed["output_dir"] == "outputs/demo"  # the interpolation outputs/${experiment_name}, resolved
    assert printed["optim"]["lr"] == 3e-4


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.totl_steps=5", "unknown config key trainer.totl_steps; did you mean trainer.total_steps?"),
        ("~trainer.totl_steps", "unknown config key trainer.totl_steps; did you mean trainer.total_steps?"),
        ("model.fp8.enabld=true", "unknown config key model.fp8.enabld; did you mean model.fp8.enabled?"),
        ("+rollout.temprature=1", "unknown config key rollout.temprature; did you mean rollout.temperature?"),
        ("trainr.total_steps=5", "unknown config key trainr; did you mean trainer, reward?"),
        ("--cfg=hydra", "--cfg hydra: only `--cfg job` (the resolved config) exists"),
    ],
)
def test_a_mistyped_key_is_one_line_naming_the_nearest_valid_ones(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run([override], capsys)
    assert (code, out, err) == (2, "", f"error: {message}\n")
