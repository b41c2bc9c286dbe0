"""The console scripts that read the job config report a config error as the trainer does: one `error: ...`
line on stderr, nothing on stdout, no traceback, exit status 2."""

from __future__ import annotations

import importlib.metadata

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
