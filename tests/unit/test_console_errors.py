"""The console scripts that read the job config report a config error as the trainer does: one `error: ...`
line on stderr, nothing on stdout, no traceback, exit status 2."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

TYPO = "error: unknown config key trainer.totl_steps; did you mean trainer.total_steps?"
NO_SUCH_OPTION = (  # Hydra's message, on one line, without its search path
    "error: In 'config': Could not find 'model/qwen3'; Available options in 'model': qwen2.5-0.5b, "
    "qwen2.5-32b, qwen2.5-7b, tiny"
)


def console_script(name: str):
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=name)
    return entry.load()


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("dapo-train", ["trainer.totl_steps=5"], TYPO),
        ("dapo-eval", ["--model", "some_model", "trainer.totl_steps=5"], TYPO),
        ("dapo-plan-memory", ["trainer.totl_steps=5"], TYPO),
        (
            "dapo-plan-memory",
            ["experiment=dapo_qwen2.5_32b", "parallel.tensor_model_parallel_size=3"],
            "error: model.num_attention_heads=40 is not divisible by parallel.tensor_model_parallel_size=3; "
            "the largest tensor-parallel size up to 3 that fits this model is 2.",
        ),
        ("dapo-plan-memory", ["model=qwen3"], NO_SUCH_OPTION),
        ("dapo-train", ["model=qwen3"], NO_SUCH_OPTION),
    ],
    ids=["train-typo", "eval-typo", "plan-typo", "plan-layout", "plan-option", "train-option"],
)
def test_a_config_error_is_one_line_and_exit_status_2(
    script: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = console_script(script)(args)
    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", message + "\n")


def test_checkpoint_export_reports_wrong_paths_as_config_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapo_megatron.checkpoint import write_manifest

    export = console_script("dapo-convert-megatron-to-hf")
    missing = tmp_path / "no_such_run"
    assert export(["--checkpoint", str(missing), "--output", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {missing} is neither a torch_dist checkpoint")

    foreign = tmp_path / "foreign" / "iter_0000001"  # complete, but not written by this project
    foreign.mkdir(parents=True)
    (foreign / "weights.bin").write_bytes(b"\0" * 8)
    write_manifest(foreign)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("precious")
    assert export(["--checkpoint", str(foreign), "--output", str(taken)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {taken} already exists and is not empty; pass --force to overwrite it\n"
    )
    assert (taken / "keep.txt").read_text() == "precious"

    assert export(["--checkpoint", str(foreign), "--output", str(tmp_path / "hf")]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        f"error: {foreign} has no dapo_model.json (not written by this project); pass "
        "--hf-config-dir with the base model's config.json\n",
    )
    assert not (tmp_path / "hf").exists()
