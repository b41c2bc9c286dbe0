"""Job-start checks of paths and the output directory, and the command line's clean config errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron import checkpoint
from dapo_megatron import config as C
from dapo_megatron.preflight import find_problems
from dapo_megatron.train import main as train_main
from tests.conftest import REPO


def job(tmp_path: Path, *overrides: str) -> C.JobConfig:
    return C.to_job_config(C.compose([f"output_dir={tmp_path / 'out'}", *overrides]))


def messages(job_config: C.JobConfig) -> list[str]:
    return [problem.message for problem in find_problems(job_config)]


def saved_checkpoint(root: Path, step: int) -> Path:
    directory = checkpoint.step_dir(root, step)
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(b"metadata")
    checkpoint.write_manifest(directory)
    return directory


def test_missing_and_empty_data_files_are_named(tmp_path: Path) -> None:
    empty, blank, good = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl", tmp_path / "good.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n")
    good.write_text('{"prompt": "1+1"}\n')
    found = messages(
        job(
            tmp_path,
            f"data.train_files=[{good},{empty},{tmp_path / 'typo.jsonl'}]",
            f"data.eval_files=[{blank}]",
        )
    )
    assert found == [
        f"data.train_files: {empty} holds no rows",
        f"data.train_files: {tmp_path / 'typo.jsonl'} does not exist (resolved from {Path.cwd()}); "
        "fix the path",
        f"data.eval_files: {blank} holds no rows",
    ]


def test_hf_dir_must_exist_and_match_the_model_shapes(tmp_path: Path) -> None:
    assert messages(job(tmp_path, f"model.hf_dir={tmp_path / 'nope'}"))[0].startswith(
        f"model.hf_dir: {tmp_path / 'nope'} does not exist"
    )
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    assert "has no config.json" in messages(job(tmp_path, f"model.hf_dir={hf_dir}"))[0]
    base = job(tmp_path, f"model.hf_dir={hf_dir}")
    hf = {**base.model.to_hf_config(), "model_type": "qwen2"}
    (hf_dir / "config.json").write_text(json.dumps(hf))
    assert messages(base) == []
    (hf_dir / "config.json").write_text(json.dumps({**hf, "hidden_size": hf["hidden_size"] * 2}))
    (found,) = messages(base)
    assert f"model.hidden_size={base.model.hidden_size} but config.json has {hf['hidden_size'] * 2}" in found


def test_load_and_resume_paths_must_hold_a_complete_checkpoint(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    found = messages(job(tmp_path, f"trainer.load={tmp_path / 'typo'}", f"trainer.resume={empty}"))
    assert found[0].startswith(f"trainer.load: {tmp_path / 'typo'} does not exist")
    assert found[1].startswith(f"trainer.resume: {empty} is neither a torch_dist checkpoint")
    good = saved_checkpoint(tmp_path / "ckpt", 3)
    assert messages(job(tmp_path, f"trainer.load={good}", f"trainer.resume={tmp_path / 'ckpt'}")) == []


def test_another_runs_checkpoints_are_not_overwritten_unless_asked(tmp_path: Path) -> None:
    root = tmp_path / "out" / "checkpoints"
    saved_checkpoint(root, 10)
    (found,) = messages(job(tmp_path, "trainer.resume=never"))
    assert "holds another run's checkpoints (steps 10..10)" in found and "trainer.overwrite=true" in found
    (found,) = messages(job(tmp_path))  # resume=auto, but the tracker is lost: it would start afresh
    assert f"Resume with trainer.resume={root}" in found
    assert messages(job(tmp_path, "trainer.resume=never", "trainer.overwrite=true")) == []
    (root / checkpoint.TRACKER_FILE).write_text("10\n")
    assert messages(job(tmp_path)) == []  # resume=auto continues it


def test_job_start_stops_on_a_path_problem_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train_main([f"output_dir={tmp_path}", f"data.train_files=[{tmp_path / 'typo.jsonl'}]"]) == 2
    assert capsys.readouterr().err == (
        f"error: data.train_files: {tmp_path / 'typo.jsonl'} does not exist "
        f"(resolved from {Path.cwd()}); fix the path\n"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "trainer.total_steps=abc",
            "error: Error merging override trainer.total_steps=abc: Value 'abc' of type 'str' "
            "could not be converted to Integer\n",
        ),
        ("trainer.total_steps=0", "error: trainer.total_steps must be >= 1; got 0.\n"),
        ("trainer.keep_last_checkpoints=-1", "error: trainer.keep_last_checkpoints must be >= 0; got -1.\n"),
        ("+trainer.typo=1", "error: unknown config key trainer.typo;"),
    ],
)
def test_config_errors_are_one_message_and_exit_2(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train_main([override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err


def test_dry_run_warns_of_missing_paths_and_fails_on_wrong_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo's base model is built by tools/demo.sh before training: a dry run before that still passes.
    assert train_main(["experiment=demo", "model.hf_dir=outputs/not_built_yet", "dry_run=true"]) == 0
    assert "warning (not found here; must exist where the job runs): model.hf_dir:" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert train_main(["experiment=demo", f"data.train_files=[{empty}]", "dry_run=true"]) == 2
    assert f"error: data.train_files: {empty} holds no rows" in capsys.readouterr().err


def test_help_and_a_bad_override_from_the_shell() -> None:
    """The real entry point: `--help` prints usage; a malformed override is one line on stderr, exit 2."""
    help_run = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert help_run.returncode == 0 and "usage: python -m dapo_megatron.train" in help_run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.train", "trainer.total_steps"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.startswith("error: Error parsing override 'trainer.total_steps'")
        and "Traceback" not in bad.stderr
    )
