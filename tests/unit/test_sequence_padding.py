"""The micro-batch padding rule: every constraint on the sequence length (sequence parallelism over TP,
FP8 GEMM alignment, context parallelism's 2 x CP chunks) combined in one multiple."""

from __future__ import annotations

import pytest

from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.fp8 import Fp8Config, transformer_config_kwargs
from dapo_megatron.models.sequence_padding import (
    job_sequence_multiple,
    model_sequence_multiple,
    padded_length,
    sequence_multiple,
)
from tests.model_configs import small_model_config


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
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
        (
            dict(context_parallel_size=2, tensor_parallel_size=3, sequence_parallel=True),
            12,
        ),  # 6 rank slices, 4 chunks
        (
            dict(context_parallel_size=2, tensor_parallel_size=8, sequence_parallel=True, fp8_alignment=16),
            256,
        ),
    ],
)
def test_sequence_multiple_combines_every_constraint(layout: dict, expected: int) -> None:
    assert sequence_multiple(**layout) == expected


def test_sequence_multiple_names_a_bad_size() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1; got 0"):
        sequence_multiple(tensor_parallel_size=0)


@pytest.mark.parametrize(
    ("length", "multiple", "expected"), [(13, 2, 14), (14, 2, 14), (1, 128, 128), (5, 1, 5)]
)
def test_padded_length(length: int, multiple: int, expected: int) -> None:
    assert padded_length(length, multiple) == expected


@pytest.mark.parametrize(
    ("sequence_parallel", "fp8", "expected"),
    [
        (False, None, 1),
        (True, None, 2),
        (False, ("hybrid", "mxfp8"), 32),
        (True, ("hybrid", "tensorwise"), 32),
    ],
)
def test_model_multiple_reads_the_transformer_config(
    sequence_parallel: bool, fp8: tuple[str, str] | None, expected: int
) -> None:
    # The forward pass reads the multiple off the model it runs: a real megatron-core TransformerConfig.
    from dapo_megatron.models.qwen2 import transformer_config

    config = transformer_config(
        small_model_config(),
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel),
    )
    if fp8:
        config.fp8, config.fp8_recipe = fp8
    assert model_sequence_multiple(config) == expected


@pytest.mark.parametrize(
    ("sequence_parallel", "fp8", "expected"),
    [
        (False, Fp8Config(), 1),
        (True, Fp8Config(), 2),
        (True, Fp8Config(enabled=False, recipe="mxfp8"), 2),
        (False, Fp8Config(enabled=True, recipe="mxfp8"), 32),
        (True, Fp8Config(enabled=True), 32),
    ],
)
def test_job_multiple_is_the_one_the_built_model_pads_to(
    sequence_parallel: bool, fp8: Fp8Config, expected: int
) -> None:
    # The planner and the config check take the multiple from the job's configs before any model exists;
    # the forward pass reads it off the TransformerConfig built from the same configs. They must agree.
    from dapo_megatron.models.qwen2 import transformer_config

    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    config = transformer_config(small_model_config(), parallel)  # FP8 set afterwards: building it needs TE
    for name, value in transformer_config_kwargs(fp8).items():
        setattr(config, name, value)
    assert job_sequence_multiple(parallel, fp8) == model_sequence_multiple(config) == expected
