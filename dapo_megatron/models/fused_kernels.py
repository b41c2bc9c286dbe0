"""Which of megatron-core's fused kernels the policy turns on: each only where the module it needs imports.

The cluster image always has Transformer Engine but apex only when it is built (`slurm/Dockerfile`, APEX_REF),
and megatron-core refuses some kernels without their module at model build: `ColumnParallelLinear` (the
output layer, in the Transformer Engine spec too) raises when `gradient_accumulation_fusion` is on and apex's
`fused_weight_gradient_mlp_cuda` is missing. So no kernel is assumed from the presence of another.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

FUSED_KERNELS: dict[str, tuple[str, ...]] = {
    # TransformerConfig field -> the modules its kernel imports (megatron-core 0.16.1).
    # apex built with --cuda_ext: the weight-gradient GEMM that accumulates into the fp32 main_grad.
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
    # apex's softmax kernels, used by megatron's own attention only (TE's attention has its own).
    "masked_softmax_fusion": ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda"),
    # apex.contrib's persistent LayerNorm, used by megatron's FusedLayerNorm only.
    "persist_layer_norm": ("apex.contrib.layer_norm.layer_norm",),
    # Transformer Engine's fused RoPE.
    "apply_rope_fusion": ("transformer_engine",),
    # megatron-core's own jit-compiled torch code: nothing to import.
    "bias_activation_fusion": (),
    "bias_dropout_fusion": (),
}


def importable(module: str) -> bool:
    """Whether `module` can be imported, without importing it (its parent packages are)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or an unrelated one of the same name
        return False


def fused_kernel_flags(
    transformer_engine: bool, is_importable: Callable[[str], bool] | None = None
) -> dict[str, bool]:
    """TransformerConfig's fused-kernel fields. All off on megatron-core's local (torch) layers, which the
    CPU path and laptops use; with Transformer Engine layers each one whose modules import
    (`is_importable`, default `importable`)."""
    is_importable = is_importable or importable
    return {
        field: transformer_engine and all(is_importable(module) for module in modules)
        for field, modules in FUSED_KERNELS.items()
    }


def describe(transformer_engine: bool, is_importable: Callable[[str], bool] | None = None) -> str:
    """One line for the job's banner: the fused kernels on, and for each one off the module it lacks."""
    if not transformer_engine:
        return "fused kernels: off (megatron-core's local layers)"
    is_importable = is_importable or importable
    flags = fused_kernel_flags(transformer_engine, is_importable)
    on = [field for field, enabled in flags.items() if enabled]
    off = [
        f"{field} (no {', '.join(m for m in FUSED_KERNELS[field] if not is_importable(m))})"
        for field, enabled in flags.items()
        if not enabled
    ]
    return f"fused kernels on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"
