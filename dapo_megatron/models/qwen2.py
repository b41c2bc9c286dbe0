"""Build a Qwen2-family policy as a megatron-core `GPTModel`.

Qwen2 = RMSNorm, SwiGLU MLP, grouped-query attention with QKV bias, RoPE, optionally tied
embeddings. The layer implementation is chosen here and only here: Transformer Engine layers on
GPUs (where FP8 plugs in), megatron-core's local torch layers otherwise (CPU tests, laptops).
Both save under the same `dist_checkpointing` keys, so checkpoints move freely between them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

import torch
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from dapo_megatron import backends
from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models import fp8
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.fused_kernels import fused_kernel_flags
from dapo_megatron.models.norm import RMSNorm

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_transformer_impl(model: ModelConfig, fp8_env: fp8.Fp8Environment | None = None) -> str:
    """`local` or `transformer_engine`, with a clear error when TE is requested but cannot run.

    With FP8 on, `auto` must not fall back to local layers silently: the FP8 checks run first, against
    `fp8_env` (this machine when None).
    """
    if model.fp8.enabled:
        fp8.check_environment(
            model.fp8, fp8_env or fp8.detect_environment(), transformer_impl=model.transformer_impl
        )
        return "transformer_engine"
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    if model.transformer_impl == "auto":
        return "transformer_engine" if te_installed and backends.detect().runs_transformer_engine else "local"
    if model.transformer_impl == "transformer_engine":
        backends.detect().check_transformer_engine()
        if not te_installed:
            raise RuntimeError(
                "model.transformer_impl=transformer_engine but Transformer Engine is not installed. "
                "Run inside the project's cluster image (slurm/Dockerfile), or set "
                "model.transformer_impl=local."
            )
    return model.transformer_impl


def transformer_config(
    model: ModelConfig, parallel: ParallelConfig, fp8_env: fp8.Fp8Environment | None = None
) -> TransformerConfig:
    """megatron-core's TransformerConfig for a Qwen2 model under the given parallel layout (`fp8_env`: see
    `resolve_transformer_impl`)."""
    dtype = _DTYPES[model.params_dtype]
    on_gpu_with_te = resolve_transformer_impl(model, fp8_env) == "transformer_engine"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        # Qwen2 trains without dropout, and RL log-probs must be deterministic functions of the weights.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        # RL micro-batches have different lengths; pipeline stages must exchange shapes.
        variable_seq_lengths=parallel.pipeline_model_parallel_size > 1,
        # megatron-core rejects variable lengths with the default MoE dispatcher even for dense models.
        moe_token_dispatcher_type="alltoall",
        # Losses are returned as (sum, count) per micro-batch; megatron-core all-reduces the counts over
        # data parallel and divides the gradients once, so every loss is an exact mean over the whole
        # optimizer batch whatever the DP size and micro-batch split (see trainer/forward.py).
        calculate_per_token_loss=True,
        use_cpu_initialization=backends.detect().init_on_host,
        **fused_kernel_flags(on_gpu_with_te),
        **parallel.recompute_kwargs(),
        **fp8.transformer_config_kwargs(model.fp8),
    )


def local_block_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """This stage's block of megatron-core's local (torch) layers, with the project's RMSNorm in every
    layer and as the final norm: megatron-core's own torch norm refuses sequence parallelism
    (`models/norm.py`)."""
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    layer = dataclasses.replace(
        layer,
        submodules=dataclasses.replace(layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm),
    )
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm
    )


def build_gpt_model(model: ModelConfig, parallel: ParallelConfig, layout: ParallelLayout) -> GPTModel:
    """This rank's part of the policy: its TP shard of the layers of its pipeline stage."""
    config = transformer_config(model, parallel)
    if resolve_transformer_impl(model) == "transformer_engine":
        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = local_block_spec(config)
    # With model.fp8.param_gather the TE layers must create their weights as FP8 tensors
    # (fp8_model_init); otherwise this is a no-op context.
    with get_fp8_context(config, is_init=True):
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=model.padded_vocab_size(layout.tp_size),
            max_sequence_length=model.max_position_embeddings,
            pre_process=layout.is_first_stage,
            post_process=layout.is_last_stage,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base),
        )
    return gpt.to(layout.device)
