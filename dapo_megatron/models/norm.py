"""RMSNorm for megatron-core's local (torch) layers that also runs under sequence parallelism.

megatron-core's `WrappedTorchNorm` refuses sequence parallelism. The reason is bookkeeping, not
arithmetic: under sequence parallelism each TP rank normalises its own slice of the sequence, so the
gradient of the (replicated) norm weight on one rank covers only that slice. Transformer Engine's and
apex's norms mark their weights `sequence_parallel`, and megatron-core's `finalize_model_grads` then
sums those gradients over the TP group. This norm does the same, so the local layer spec (CPU, gloo)
runs sequence parallelism with the same numbers as `torch.nn.RMSNorm`.
"""

from __future__ import annotations

from typing import Any

import torch


class RMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` with megatron-core's norm constructor, its weight marked for the TP gradient
    all-reduce under sequence parallelism."""

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"dapo_megatron.models.norm.RMSNorm implements plain RMSNorm; the TransformerConfig asks "
                f"for normalization={config.normalization!r}, zero-centered gamma "
                f"{config.layernorm_zero_centered_gamma}."
            )
        # No params_dtype, as in WrappedTorchNorm: planning/memory.py counts local norms in fp32.
        super().__init__(hidden_size, eps=eps)
        # Read by finalize_model_grads (only when config.sequence_parallel is set).
        self.weight.sequence_parallel = config.sequence_parallel
