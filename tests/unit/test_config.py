"""Every config file composes into typed, validated dataclasses; impossible layouts and unknown keys fail
early with messages that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from dapo_megatron import config as C
from dapo_megatron.models.config import ModelConfig

GROUPS = sorted(p.name for p in C.CONFIG_DIR.iterdir() if p.is_dir())


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (C.CONFIG_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in options(g)])
def test_every_config_file_composes(group: str, option: str) -> None:
    # Parallel layouts are recipes for real models; the tiny model has only 4 heads.
    model = ["model=qwen2.5-32b"] if group == "parallel" else []
    job = C.to_job_config(C.compose([f"{group}={option}", *model]))
    assert isinstance(job, C.JobConfig)
    world = job.parallel.model_parallel_size
    C.validate(job, world_size=world)


def test_groups_the_issue_asks_for_exist() -> None:
    assert {"model", "parallel", "optim", "algo", "reward", "experiment"} <= set(GROUPS)
    assert {"dapo", "grpo", "dapo_seq_mean"} <= set(options("algo"))
    assert {"tiny", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b"} <= set(options("model"))


@pytest.mark.parametrize(
    ("name", "expected_params"),
    [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512), ("qwen2.5-32b", 32_763_876_352)],
)
def test_model_configs_have_the_real_shapes(name: str, expected_params: int) -> None:
    # Parameter counts of the published checkpoints (sum of numel over their safetensors).
    model = C.load([f"model={name}"]).model
    assert model.num_parameters() == expected_params


def test_experiment_overrides_groups_and_name() -> None:
    job = C.load(["experiment=tiny_tp2pp2"], world_size=4)
    assert (job.parallel.tensor_model_parallel_size, job.parallel.pipeline_model_parallel_size) == (2, 2)
    assert job.experiment_name == "tiny_tp2pp2" and job.output_dir == "outputs/tiny_tp2pp2"


@pytest.mark.parametrize("override", ["+model.num_layerz=3", "+trainers=1", "+optim.betas=1"])
def test_unknown_keys_are_errors(override: str) -> None:
    with pytest.raises(C.ConfigError, match="unknown config key"):
        C.load([override])


def test_a_misspelled_experiment_is_an_error_naming_the_options() -> None:
    # An optional group would compose the tiny default and train it as if nothing were wrong.
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="experiment/dapo_qwen2_32b") as error:
        C.load(["experiment=dapo_qwen2_32b"])
    assert "dapo_qwen2.5_32b" in str(error.value)


def test_unknown_key_in_a_yaml_file_is_an_error(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(C.CONFIG_DIR, tmp_path / "configs")
    with (tmp_path / "configs" / "model" / "tiny.yaml").open("a") as f:
        f.write("num_layerz: 3\n")
    with pytest.raises(ConfigCompositionException, match="num_layerz"):
        C.compose([], config_dir=tmp_path / "configs")


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (
            ["parallel.tensor_model_parallel_size=3"],
            3,
            "model.num_attention_heads=4 is not divisible by parallel.tensor_model_parallel_size=3",
        ),
        (
            ["model=qwen2.5-32b", "parallel.tensor_model_parallel_size=5"],
            5,
            "model.num_query_groups=8 is not divisible by parallel.tensor_model_parallel_size=5; the largest "
            "tensor-parallel size up to 5 that fits this model is 4",
        ),
        (
            ["model.num_layers=3", "parallel.pipeline_model_parallel_size=2"],
            2,
            "model.num_layers=3 is not divisible by parallel.pipeline_model_parallel_size=2",
        ),
        (["parallel=tp2pp2"], 6, "world size 6 is not a multiple of tensor x pipeline parallel = 2 x 2 = 4"),
        (["optim.lr=0"], 1, "optim.lr must be > 0"),
        (["model.params_dtype=fp8"], 1, "model.params_dtype must be"),
        (
            ["parallel.sequence_parallel=true"],
            1,
            "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1",
        ),
        (["rollout.max_response_length=600"], 1, "exceeds model.max_position_embeddings=512"),
        (
            ["model.num_attention_heads=6", "model.num_query_groups=4"],
            1,
            "model.num_attention_heads \\(6\\) must be divisible",
        ),
        (
            ["trainer.overlap_rollout=true", "algo.lag_is_cap=null"],
            1,
            "trainer.overlap_rollout=true trains each batch one step after .*; set "
            "algo.lag_is_cap \\(e.g. 2.0\\), algo.old_log_prob_source=rollout or ",
        ),
        (
            ["algo.old_log_prob_source=rollout", "rollout.sync_check=off"],
            1,
            "old_log_prob_source=rollout takes pi_old from the engine, but rollout.sync_check=off leaves",
        ),
        (
            ["algo.old_log_prob_source=rollout", "rollout.quantization=fp8"],
            1,
            "but rollout.quantization=fp8 samples from a quantized copy .*; set "
            "algo.old_log_prob_source=trainer$",
        ),
        (
            [
                "model.fp8.enabled=true",
                "model.fp8.param_gather=true",
                "parallel.use_distributed_optimizer=true",
            ],
            1,
            "model.fp8.param_gather=true .* sync would send them to the engine undequantised .*; set "
            "model.fp8.param_gather=false",
        ),
    ],
)
def test_impossible_configs_name_the_field(overrides: list[str], world: int, message: str) -> None:
    with pytest.raises(C.ConfigError, match=message):
        C.load(overrides, world_size=world)


def test_sequence_parallel_runs_on_local_layers() -> None:
    # The local layer spec carries a norm that marks its weight for the TP gradient all-reduce, so CPU and
    # laptop runs (gloo) use sequence parallelism as the GPU recipes do.
    job = C.load(
        ["parallel=tp2", "parallel.sequence_parallel=true", "model.transformer_impl=local"], world_size=2
    )
    assert job.parallel.sequence_parallel and job.model.transformer_impl == "local"


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.overlap_rollout=true", "algo.old_log_prob_source=rollout"],
        ["trainer.overlap_rollout=true", "algo.old_log_prob_source=trainer", "algo.lag_is_cap=2.0"],
    ],
)
def test_a_batch_generated_ahead_trains_on_pi_old_or_with_the_decoupled_correction(
    overrides: list[str],
) -> None:
    job = C.load(overrides)
    assert job.trainer.overlap_rollout


def test_validation_happens_before_megatron_is_imported() -> None:
    import subprocess
    import sys

    code = (
        "import sys\nfrom dapo_megatron import config as C\n"
        "try:\n    C.load(['parallel.tensor_model_parallel_size=3'], world_size=3)\n"
        "except C.ConfigError:\n    pass\n"
        "assert 'megatron' not in sys.modules, 'validation imported megatron'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vocab_padding_is_layout_independent_for_power_of_two_tp() -> None:
    model = ModelConfig(vocab_size=250)
    assert {model.padded_vocab_size(tp) for tp in (1, 2, 4, 8)} == {256}
    assert ModelConfig(vocab_size=152064).padded_vocab_size(8) == 152064
    assert ModelConfig(vocab_size=250).padded_vocab_size(3) == 384


def test_hf_config_round_trip() -> None:
    model = C.load(["model=qwen2.5-32b"]).model
    again = ModelConfig.from_hf_config(model.to_hf_config(), name=model.name, params_dtype=model.params_dtype)
    assert again == model
    with pytest.raises(ValueError, match="model_type='llama'"):
        ModelConfig.from_hf_config({**model.to_hf_config(), "model_type": "llama"})


def test_token_budget_must_hold_the_longest_row_as_padded() -> None:
    # FP8 at TP 8 with sequence parallelism pads every micro-batch to a multiple of 8 x 16 = 128: a
    # 100 + 200 = 300-token row is computed as 384 tokens, so a budget of 383 would refuse it mid-run.
    bf16 = [
        "model=qwen2.5-32b",
        "parallel.tensor_model_parallel_size=8",
        "parallel.sequence_parallel=true",
        "rollout.max_prompt_length=100",
        "rollout.max_response_length=200",
    ]
    fp8 = [*bf16, "model.fp8.enabled=true"]
    with pytest.raises(
        C.ConfigError,
        match=r"max_tokens_per_micro_batch=383 cannot hold .* = 300 tokens, which the "
        r"model computes as 384 \(.* multiple of 128: parallel.sequence_parallel"
        r" .*model.fp8 .*\); raise it to at least 384",
    ):
        C.load([*fp8, "trainer.max_tokens_per_micro_batch=383"], world_size=8)
    assert C.load(
        [*fp8, "trainer.max_tokens_per_micro_batch=384"], world_size=8
    ).trainer.max_tokens_per_micro_batch
    # In bf16 the layout pads to a multiple of 8, which 300 is not either: 304.
    with pytest.raises(C.ConfigError, match=r"computes as 304 .* multiple of 8: parallel\.sequence_parallel"):
        C.load([*bf16, "trainer.max_tokens_per_micro_batch=303"], world_size=8)
