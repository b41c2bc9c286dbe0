"""The one rule for how far a micro-batch's sequence is right-padded before the model sees it.

Three layouts put constraints on the sequence length of every micro-batch:

* Sequence parallelism splits the sequence into TP equal slices outside the matmuls (megatron-core's
  scatter to the sequence-parallel region and the reduce-scatter after each row-parallel linear), so
  the length must be a multiple of the TP size.
* Context parallelism (megatron-core's load-balanced split) cuts the sequence into 2 x CP chunks and
  gives each CP rank two of them; sequence parallelism then splits a CP rank's share over TP.
* FP8 GEMMs in Transformer Engine need the token dimension of every GEMM input to be a multiple of
  the GEMM alignment (`Fp8Config.gemm_alignment`); under sequence and context parallelism that is the
  length divided by CP x TP, times the micro-batch size. Padding the length to alignment x CP x TP
  makes it true for any micro-batch size.

Padding goes at the right end, where causal attention keeps it from reaching any real position; the
trainer cuts the model's output back to the real width before the loss (`trainer/forward.py`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dapo_megatron.models.fp8 import Fp8Config

if TYPE_CHECKING:
    from dapo_megatron.distributed.config import ParallelConfig


def sequence_multiple(
    *,
    tensor_parallel_size: int = 1,
    sequence_parallel: bool = False,
    context_parallel_size: int = 1,
    fp8_alignment: int = 1,
) -> int:
    """Pad every micro-batch's sequence length to a multiple of this (1 = no padding).

    `fp8_alignment`: the FP8 GEMM alignment when FP8 is on, 1 when it is off.
    """
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("context_parallel_size", context_parallel_size),
        ("fp8_alignment", fp8_alignment),
    ):
        if value < 1:
            raise ValueError(f"sequence_multiple: {name} must be >= 1; got {value}.")
    # Sequence length that each rank's slice is a 1/split of: every split must be whole.
    split = context_parallel_size * (tensor_parallel_size if sequence_parallel else 1)
    load_balanced_chunks = 2 * context_parallel_size if context_parallel_size > 1 else 1
    return math.lcm(split * fp8_alignment, load_balanced_chunks)


def model_sequence_multiple(config: Any) -> int:
    """`sequence_multiple` for a megatron-core TransformerConfig (the model the forward pass runs)."""
    fp8_alignment = Fp8Config(recipe=config.fp8_recipe or "delayed").gemm_alignment if config.fp8 else 1
    return sequence_multiple(
        tensor_parallel_size=config.tensor_model_parallel_size,
        sequence_parallel=config.sequence_parallel,
        context_parallel_size=config.context_parallel_size,
        fp8_alignment=fp8_alignment,
    )


def job_sequence_multiple(parallel: ParallelConfig, fp8: Fp8Config) -> int:
    """`sequence_multiple` from a job's configs (`parallel`, `model.fp8`), before any model exists: the
    multiple `model_sequence_multiple` reads off the model built from them. The trainer plans token-budget
    micro-batches (`trainer/packing.py`) and the config check and memory planner size them with it."""
    # No context parallelism: ParallelConfig has no CP size, and the model is built with CP 1.
    return sequence_multiple(
        tensor_parallel_size=parallel.tensor_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        fp8_alignment=fp8.gemm_alignment if fp8.enabled else 1,
    )


def job_padding_reason(parallel: ParallelConfig, fp8: Fp8Config) -> str:
    """Which settings make `job_sequence_multiple` what it is, for messages ("" when it is 1)."""
    reasons = []
    if parallel.sequence_parallel:
        reasons.append(
            "parallel.sequence_parallel splits the sequence over parallel.tensor_model_parallel_size="
            f"{parallel.tensor_model_parallel_size}"
        )
    if fp8.enabled:
        reasons.append(f"model.fp8 GEMMs need a multiple of {fp8.gemm_alignment} tokens on each rank")
    return "; ".join(reasons)


def padded_length(length: int, multiple: int) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple
