"""FP8 settings: the exact megatron-core fields they become, every "cannot run here" error (described through
`Fp8Environment`, not by patching torch), shape alignment, FP8 rollouts' TIS rule, and the micro-batch padding
FP8 GEMMs need (run for real through megatron-core's schedule on CPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dapo_megatron import backends
from dapo_megatron import config as C
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models import fp8
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine
from tests.conftest import one_gloo_rank
from tests.model_configs import small_model_config

H100 = fp8.Fp8Environment(
    te_version=(2, 8), cuda_available=True, device_name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0)
)
B200 = dataclasses.replace(H100, device_name="NVIDIA B200", compute_capability=(10, 0))
A100 = dataclasses.replace(H100, device_name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0))
NO_TE = dataclasses.replace(H100, te_version=None)
NO_CUDA = fp8.Fp8Environment(te_version=None, cuda_available=False)
ON = fp8.Fp8Config(enabled=True)


def test_settings_map_onto_megatron_core_fields() -> None:
    assert fp8.transformer_config_kwargs(fp8.Fp8Config()) == {}
    settings = fp8.Fp8Config(
        enabled=True,
        format="e4m3",
        recipe="blockwise",
        margin=1,
        amax_history_len=16,
        amax_compute_algo="most_recent",
        param_gather=True,
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=2,
        num_layers_at_end_in_bf16=0,
    )
    assert fp8.transformer_config_kwargs(settings) == {
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "fp8_margin": 1,
        "fp8_amax_history_len": 16,
        "fp8_amax_compute_algo": "most_recent",
        "fp8_param": True,
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 2,
        "num_layers_at_end_in_bf16": 0,
    }


@pytest.mark.parametrize("recipe", fp8.FP8_RECIPES)
def test_megatron_core_accepts_the_fields_for_every_recipe(recipe: str) -> None:
    from megatron.core.transformer import TransformerConfig

    settings = fp8.Fp8Config(
        enabled=True, recipe=recipe, param_gather=True, first_last_layers_bf16=recipe != "delayed"
    )
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        **fp8.transformer_config_kwargs(settings),
    )
    assert (config.fp8, config.fp8_recipe, config.fp8_param) == ("hybrid", recipe, True)
    assert config.first_last_layers_bf16 == (recipe != "delayed")


def test_the_builder_passes_fp8_fields_and_te_fusions(monkeypatch: pytest.MonkeyPatch) -> None:
    # TE's fused kernels cannot be configured without TE, so record the kwargs instead of building.
    from dapo_megatron.models import fused_kernels, qwen2

    monkeypatch.setattr(qwen2, "TransformerConfig", dict)
    # The cluster image with apex built in: every fused kernel's module imports.
    monkeypatch.setattr(fused_kernels, "importable", lambda module: True)
    kwargs = qwen2.transformer_config(small_model_config(fp8=ON), ParallelConfig(), fp8_env=H100)
    assert {k: kwargs[k] for k in ("fp8", "fp8_recipe", "fp8_param")} == {
        "fp8": "hybrid",
        "fp8_recipe": "tensorwise",
        "fp8_param": False,
    }
    assert kwargs["gradient_accumulation_fusion"] and kwargs["apply_rope_fusion"]
    assert "fp8" not in qwen2.transformer_config(small_model_config(params_dtype="float32"), ParallelConfig())


@pytest.mark.parametrize(
    ("settings", "env", "impl", "message"),
    [
        (ON, H100, "local", "model.transformer_impl=local"),
        (ON, NO_CUDA, "auto", "needs a CUDA GPU"),
        (ON, NO_TE, "auto", "needs Transformer Engine, which is not installed"),
        (
            ON,
            dataclasses.replace(H100, te_version=(2, 1)),
            "auto",
            r"recipe=tensorwise needs Transformer Engine >= 2\.2",
        ),
        (
            fp8.Fp8Config(enabled=True, recipe="blockwise"),
            dataclasses.replace(H100, te_version=(2, 2)),
            "auto",
            ">= 2.3",
        ),
        (
            ON,
            A100,
            "auto",
            r"Hopper or newer GPU \(compute capability >= 9\.0\); NVIDIA A100-SXM4-80GB has 8\.0",
        ),
        (fp8.Fp8Config(enabled=True, recipe="mxfp8"), H100, "transformer_engine", r"Blackwell .* >= 10\.0"),
    ],
)
def test_environment_errors_name_the_cause_and_the_fix(
    settings: fp8.Fp8Config, env: fp8.Fp8Environment, impl: str, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message) as error:
        fp8.check_environment(settings, env, transformer_impl=impl)
    assert "model.fp8.enabled=false" in str(error.value)


@pytest.mark.parametrize(
    ("settings", "env"),
    [(ON, H100), (fp8.Fp8Config(enabled=True, recipe="mxfp8"), B200), (fp8.Fp8Config(), NO_CUDA)],
)
def test_environment_that_can_run_passes(settings: fp8.Fp8Config, env: fp8.Fp8Environment) -> None:
    fp8.check_environment(settings, env, transformer_impl="auto")


def test_auto_does_not_fall_back_to_local_layers_with_fp8() -> None:
    from dapo_megatron.models.qwen2 import resolve_transformer_impl

    with pytest.raises(RuntimeError, match="not installed"):
        resolve_transformer_impl(small_model_config(fp8=ON), fp8_env=NO_TE)
    assert resolve_transformer_impl(small_model_config(fp8=ON), fp8_env=H100) == "transformer_engine"


def test_this_machine_is_detected_without_fp8_support() -> None:
    env = fp8.detect_environment()
    assert env.cuda_available == torch.cuda.is_available()
    if not env.cuda_available:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            fp8.check_environment(ON, env, transformer_impl="auto")


@pytest.mark.parametrize(("model", "tp"), [("qwen2.5-0.5b", 2), ("qwen2.5-7b", 4), ("qwen2.5-32b", 8)])
@pytest.mark.parametrize("recipe", fp8.FP8_RECIPES)
def test_qwen_shapes_are_fp8_aligned(model: str, tp: int, recipe: str) -> None:
    job = C.load(
        [
            f"model={model}",
            "model.fp8.enabled=true",
            f"model.fp8.recipe={recipe}",
            f"parallel.tensor_model_parallel_size={tp}",
            "parallel.use_distributed_optimizer=true",
        ],
        world_size=tp,
    )
    assert job.model.fp8.enabled


def test_misaligned_shapes_are_refused_with_the_nearest_fitting_tp() -> None:
    shapes = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16)
    # ffn 160: 80 per rank at TP2 (a multiple of 16), 40 at TP4.
    assert fp8.alignment_error(ffn_hidden_size=160, tensor_parallel_size=2, fp8=ON, **shapes) is None
    error = fp8.alignment_error(ffn_hidden_size=160, tensor_parallel_size=4, fp8=ON, **shapes)
    assert error is not None and "model.ffn_hidden_size / TP = 40" in error
    assert "Use parallel.tensor_model_parallel_size=2" in error
    assert (
        fp8.alignment_error(ffn_hidden_size=160, tensor_parallel_size=4, fp8=fp8.Fp8Config(), **shapes)
        is None
    )
    # MXFP8 blocks are 32 wide: 80 is not enough any more.
    mxfp8 = fp8.Fp8Config(enabled=True, recipe="mxfp8")
    assert "multiple of 32" in (
        fp8.alignment_error(ffn_hidden_size=160, tensor_parallel_size=2, fp8=mxfp8, **shapes) or ""
    )
    with pytest.raises(C.ConfigError, match=r"model.hidden_size = 72 .* Use another model"):
        C.load(["model.fp8.enabled=true", "model.hidden_size=72", "model.kv_channels=16"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.fp8.enabled=true", "model.transformer_impl=local"], "model.transformer_impl=auto"),
        (
            ["model.fp8.enabled=true", "model.fp8.recipe=delayed", "model.fp8.first_last_layers_bf16=true"],
            "recipe=delayed",
        ),
        (["model.fp8.recipe=fp4"], "model.fp8.recipe must be one of"),
        (
            ["model.fp8.enabled=true", "model.fp8.param_gather=true"],
            "parallel.use_distributed_optimizer=true",
        ),
        (
            [
                "model.fp8.enabled=true",
                "model.fp8.first_last_layers_bf16=true",
                "model.fp8.num_layers_at_end_in_bf16=3",
                "parallel=pp2",
            ],
            "num_layers_at_end_in_bf16=3 exceeds the 2 layers",
        ),
        (["rollout.quantization=fp8"], "set algo.tis_cap"),
        (["rollout.quantization=int4"], "rollout.quantization must be null or fp8"),
    ],
)
def test_config_errors_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(C.ConfigError, match=message):
        C.load(overrides, world_size=2)


def test_fp8_rollouts_with_truncated_importance_sampling_are_accepted() -> None:
    job = C.load(["rollout.quantization=fp8", "algo.tis_cap=2.0"])
    cuda = SGLangEngine("model", job.rollout, log_file="engine.log", backend=backends.CUDA).command()
    assert cuda[cuda.index("--quantization") + 1] == "fp8"
    assert (
        "--quantization"
        not in SGLangEngine("model", RolloutConfig(), log_file="x.log", backend=backends.CUDA).command()
    )
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        SGLangEngine("model", job.rollout, log_file="engine.log", backend=backends.CPU)


def test_settings_survive_the_checkpoint_json() -> None:
    model = small_model_config(fp8=fp8.Fp8Config(enabled=True, recipe="blockwise"))
    assert ModelConfig(**dataclasses.asdict(model)) == model


@pytest.fixture
def one_rank_megatron(tmp_path: Path) -> Iterator[object]:
    with one_gloo_rank(tmp_path / "store") as layout:
        yield layout


def test_fp8_micro_batches_are_padded_and_cut_back(one_rank_megatron: object) -> None:
    """With fp8 set on the model's config, the model sees 16-aligned sequences and the loss gets the real
    width back with the same values (on CPU the FP8 context is a no-op, so only the padding differs)."""
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.records import MicroBatch
    from dapo_megatron.trainer.forward import run_schedule

    model = build_gpt_model(small_model_config(params_dtype="float32"), ParallelConfig(), one_rank_megatron)  # type: ignore[arg-type]
    seen: list[int] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    tokens = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    batches = [MicroBatch(tokens=tokens), MicroBatch(tokens=tokens[:, :5])]

    def keep(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        return logits.sum(), torch.ones((), dtype=torch.int), {"logits": logits.detach().clone()}

    with torch.no_grad():
        plain = run_schedule(model, batches, keep, forward_only=True, with_labels=False)
        model.config.fp8, model.config.fp8_recipe = "hybrid", "tensorwise"
        padded = run_schedule(model, batches, keep, forward_only=True, with_labels=False)
    assert seen == [7, 5, 16, 16]
    for before, after in zip(plain, padded, strict=True):
        torch.testing.assert_close(after["logits"], before["logits"], rtol=0, atol=1e-6)


def test_the_sync_check_scores_the_probe_in_the_weights_dtype(tmp_path: Path) -> None:
    """The engine holds the bf16 weights the trainer sent; an FP8 forward would differ from them by FP8's
    rounding. The probe's trainer side runs with `TransformerConfig.fp8` cleared (megatron-core reads it at
    each forward), and the training forward passes keep it."""
    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.models.weights import unwrap_model
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.sync_probe import SyncProbe
    from tests.conftest import tiny_policy

    with one_gloo_rank(tmp_path / "store") as layout:
        model, cfg = tiny_policy(layout, vocab_size=64)
        config = unwrap_model(model).config
        config.fp8 = (
            "hybrid"  # as model.fp8.enabled sets it (TE's layers are GPU-only; the flag is what counts)
        )
        actor = Actor(model, None, None, AlgoConfig(), layout, vocab_size=cfg.vocab_size)
        seen = []
        compute = actor.compute_log_probs
        actor.compute_log_probs = lambda *args, **kwargs: seen.append(config.fp8) or compute(*args, **kwargs)
        probe = SyncProbe([[1, 2, 3], [4, 5]], [6, 7], pad_token_id=0)
        log_probs = probe.trainer_log_probs(actor, micro_batch_size=2)
        assert seen == [None] and config.fp8 == "hybrid"
        assert log_probs.shape == probe.rows.response_mask.shape and bool((log_probs <= 0).all())
