"""The micro-batch padding rule: every constraint on the sequence length (sequence parallelism over TP,
FP8 GEMM alignment, context parallelism's 2 x CP chunks) combined in one multiple."""

from __future__ import annotations

import pytest

from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.sequence_padding import model_sequence_multiple, padded_length, sequence_multiple


@pytest.mark.parametrize(("layout", "expected"), [
    (dict(), 1),
    (dict(tensor_parallel_size=8), 1),  # TP alone keeps the whole sequence on every rank
    (dict(tensor_parallel_size=8, sequence_parallel=True), 8),
    (dict(tensor_parallel_size=4, sequence_parallel=True), 4),
    (dict(tensor_parallel_size=8, fp8_alignment=16), 16),
    (dict(tensor_parallel_size=8, sequence_parallel=True, fp8_alignment=16), 128),
    (dict(tensor_parallel_size=2, fp8_alignment=32), 32),
    (dict(tensor_parallel_size=2, sequence_parallel=True, fp8_alignment=32), 64),
    (dict(context_parallel_size=2), 4),  # 2 x CP load-balanced chunks
    (dict(context_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True), 4),
    (dict(context_parallel_size=2, tensor_parallel_size=3, sequence_parallel=True), 12),  # 6 rank slices, 4 chunks
    (dict(context_parallel_size=2, tensor_parallel_size=8, sequence_parallel=True, fp8_alignment=16), 256),
])
def test_sequence_multiple_combines_every_constraint(layout: dict, expected: int) -> None:
    assert sequence_multiple(**layout) == expected


def test_sequence_multiple_names_a_bad_size() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1; got 0"):
        sequence_multiple(tensor_parallel_size=0)


@pytest.mark.parametrize(("length", "multiple", "expected"), [(13, 2, 14), (14, 2, 14), (1, 128, 128), (5, 1, 5)])
def test_padded_length(length: int, multiple: int, expected: int) -> None:
    assert padded_length(length, multiple) == expected


@pytest.mark.parametrize(("sequence_parallel", "fp8", "expected"), [
    (False, None, 1), (True, None, 2), (False, ("hybrid", "mxfp8"), 32), (True, ("hybrid", "tensorwise"), 32)])
def test_model_multiple_reads_the_transformer_config(sequence_parallel: bool, fp8: tuple[str, str] | None,
                                                     expected: int) -> None:
    # The forward pass reads the multiple off the model it runs: a real megatron-core TransformerConfig.
    from dapo_megatron.models.qwen2 import transformer_config

    config = transformer_config(ModelConfig(), ParallelConfig(tensor_model_parallel_size=2,
                                                              sequence_parallel=sequence_parallel))
    if fp8:
        config.fp8, config.fp8_recipe = fp8
    assert model_sequence_multiple(config) == expected
