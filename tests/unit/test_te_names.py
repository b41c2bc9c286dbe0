"""A model built from megatron-core's Transformer Engine layer spec loads Hugging Face weights, exports them
back bit-exactly, pushes them under the right HF names, and checkpoints under the local spec's keys.

Transformer Engine cannot run here. megatron-core's own `get_gpt_layer_with_transformer_engine_spec` builds
the spec, with its backend provider swapped for one whose fused norm + column-parallel linear is a stand-in
carrying TE's parameter names and shapes (`layer_norm_weight`, `weight`, `bias`) and its arithmetic (RMSNorm,
then the linear layer). The module tree is therefore the TE spec's: the norms sit inside `linear_qkv` and
`linear_fc1`, and `input_layernorm` / `pre_mlp_layernorm` are IdentityOp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import one_gloo_rank, tiny_qwen2

# TE's names for one decoder layer of a Qwen2 GPTModel (QKV bias, no other linear bias, RMSNorm: TE's
# LayerNormLinear has no `layer_norm_bias` for RMSNorm and registers no `bias` parameter without one).
TE_LAYER_PARAMS = {
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
}


def te_spec_gpt_model(cfg: Any, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.models.qwen2 import transformer_config

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """TELayerNormColumnParallelLinear's parameters and arithmetic on megatron's local linear layer."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.eps = config.layernorm_epsilon

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
            return super().forward(normed, *args, **kwargs)

    class StandInTESpecProvider(LocalSpecProvider):
        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return LayerNormColumnParallelLinear

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", StandInTESpecProvider, raising=False)
    return GPTModel(
        config=transformer_config(cfg, ParallelConfig()),
        transformer_layer_spec=gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=cfg.padded_vocab_size(1),
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rotary_base),
    )


def test_te_spec_model_loads_exports_and_pushes_hf_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dapo_megatron import checkpoint
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.models import hf_io, hf_mapping
    from dapo_megatron.models.config import ModelConfig
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.models.weights import gather_full_state, load_hf_weights
    from dapo_megatron.rollout.weight_sync import iter_hf_tensors

    hf_dir = tmp_path / "hf"
    hf_model = tiny_qwen2(hf_dir, vocab_size=250, num_layers=2)
    original = hf_io.load_hf_state(hf_dir)
    cfg = ModelConfig.from_hf_config(
        hf_io.read_hf_config(hf_dir), params_dtype="float32", transformer_impl="local"
    )
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        expected = hf_model(tokens).logits

    with one_gloo_rank(tmp_path / "store") as layout:
        model = te_spec_gpt_model(cfg, monkeypatch).eval()
        layer_params = {
            name.removeprefix("decoder.layers.0.")
            for name, _ in model.named_parameters()
            if name.startswith("decoder.layers.0.")
        }
        assert layer_params == TE_LAYER_PARAMS

        load_hf_weights(model, hf_dir, cfg, layout)
        with torch.no_grad():
            logits = model(tokens, positions, None)[..., : cfg.vocab_size]
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=2e-5)

        exported = hf_mapping.megatron_state_to_hf(gather_full_state(model, cfg, layout), cfg)
        pushed = dict(iter_hf_tensors(model, cfg, layout))
        for hf_state in (exported, pushed):
            assert hf_state.keys() == original.keys()
            for name, tensor in original.items():
                assert torch.equal(hf_state[name], tensor), name

        # torch_dist keys do not depend on the layer spec: a TE-spec save loads into a local-spec model.
        saved = checkpoint.save_model(model, tmp_path / "ckpt", step=0, model_cfg=cfg, layout=layout)
        local = build_gpt_model(cfg, ParallelConfig(), layout).eval()
        checkpoint.load_model(local, saved)
        with torch.no_grad():
            torch.testing.assert_close(
                local(tokens, positions, None)[..., : cfg.vocab_size], logits, rtol=0, atol=0
            )


def test_extra_state_is_not_a_weight_in_any_form() -> None:
    from dapo_megatron.models.hf_mapping import canonical_megatron_name

    # TE's FP8 metadata in memory, and as torch_dist stores the local spec's (a ShardedObject per layer
    # block).
    for name in (
        "decoder.layers.3.self_attention.linear_qkv._extra_state",
        "decoder.layers.self_attention.linear_proj._extra_state/shard_0_8",
    ):
        assert canonical_megatron_name(name) is None, name
    assert (
        canonical_megatron_name("decoder.layers.3.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.3.pre_mlp_layernorm.weight"
    )
