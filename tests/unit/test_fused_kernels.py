"""megatron-core's fused kernels are turned on one by one, each only where its module imports
(`models/fused_kernels.py`): the cluster image has Transformer Engine and apex only when built with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron import config as C
from dapo_megatron.models import fused_kernels, qwen2
from dapo_megatron.models.fused_kernels import FUSED_KERNELS, describe, fused_kernel_flags
from tests.conftest import one_gloo_rank

TE_WITHOUT_APEX = {"transformer_engine"}.__contains__
TE_AND_APEX = {module for modules in FUSED_KERNELS.values() for module in modules}.__contains__


def test_each_kernel_needs_its_own_module() -> None:
    assert not any(fused_kernel_flags(False, TE_AND_APEX).values())  # local layers: none
    assert all(fused_kernel_flags(True, TE_AND_APEX).values())
    image = fused_kernel_flags(True, TE_WITHOUT_APEX)  # the image built without APEX_REF
    assert image == {
        "gradient_accumulation_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": True,
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
    }
    line = describe(True, TE_WITHOUT_APEX)
    assert line.startswith(
        "fused kernels on: apply_rope_fusion, bias_activation_fusion, bias_dropout_fusion;"
    )
    assert "gradient_accumulation_fusion (no fused_weight_gradient_mlp_cuda)" in line
    assert describe(False) == "fused kernels: off (megatron-core's local layers)"


def test_a_missing_parent_package_is_not_importable() -> None:
    assert not fused_kernels.importable("no_such_package_dapo.contrib.layer_norm")
    assert fused_kernels.importable("json")


def test_transformer_engine_layers_without_apex_build_the_output_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy's config on Transformer Engine layers where apex is missing (this machine stands in for the
    image without APEX_REF; TE's own fused RoPE is off here too, as TE is absent): megatron-core's output
    layer, a ColumnParallelLinear in the TE spec as well, builds. With gradient accumulation fusion forced on
    it raises, as it did on every rank when TE's presence turned every fused kernel on."""
    import dataclasses

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from dapo_megatron.distributed.config import ParallelConfig

    monkeypatch.setattr(qwen2, "resolve_transformer_impl", lambda model, fp8_env=None: "transformer_engine")
    model = C.to_job_config(C.compose([])).model  # the tiny preset
    with one_gloo_rank(tmp_path / "store"):
        config = qwen2.transformer_config(model, ParallelConfig())
        assert not config.gradient_accumulation_fusion and config.bias_activation_fusion
        ColumnParallelLinear(64, 128, config=config, init_method=config.init_method, bias=False)
        forced = dataclasses.replace(config, gradient_accumulation_fusion=True)
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            ColumnParallelLinear(64, 128, config=forced, init_method=config.init_method, bias=False)
