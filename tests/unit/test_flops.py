"""MFU arithmetic for tools/gpu_check.py (hand-computed numbers), the GPU peak table, and the tool's no-GPU
exit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dapo_megatron import config as C
from dapo_megatron import flops
from tests.conftest import REPO
from tests.model_configs import small_model_config

TINY = small_model_config()  # 2 layers, hidden 64, 4 heads in 2 query groups, FFN 128, vocab 256


def test_matmul_parameters_by_hand() -> None:
    # Per layer: QKV 64 x (64 + 2 x 32) + output 64 x 64 + SwiGLU 3 x 64 x 128 = 36864; plus the output
    # layer 64 x 256.
    assert flops.matmul_parameters(TINY) == 2 * 36864 + 64 * 256


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-0.5b", "qwen2.5-32b"])
def test_matmul_parameters_leave_out_exactly_embeddings_norms_and_biases(name: str) -> None:
    model = C.load([f"model={name}"]).model
    qkv_bias = (model.num_attention_heads + 2 * model.num_query_groups) * model.head_dim
    norms = (2 * model.num_layers + 1) * model.hidden_size
    # Tied models share the output layer with the input embedding, which the matmul count includes once.
    input_embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    assert model.num_parameters() - flops.matmul_parameters(model) == (
        model.num_layers * qkv_bias + norms + input_embedding
    )


def test_training_flops_by_hand() -> None:
    # 6 x 90112 x 10 (matmuls) + 12 x 2 layers x 64 x 10^2 (attention), summed over two sequences.
    assert flops.training_flops(TINY, [10, 10]) == 2 * (6 * 90112 * 10 + 12 * 2 * 64 * 100)
    assert flops.training_flops(TINY, []) == 0


@pytest.mark.parametrize(
    ("device", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 80GB HBM3", "fp8", 1979.0),
        ("NVIDIA H200", "fp8", 1979.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "fp8", None),
        ("Tesla T4", "bf16", None),
    ],
)
def test_peak_table(device: str, precision: str, peak: float | None) -> None:
    assert flops.peak_tflops(device, precision) == peak


def test_mfu() -> None:
    # Half of two H100s' bf16 peak for 2 s.
    assert flops.mfu(989e12 * 2, 2.0, num_gpus=2, peak_tflops_per_gpu=989.0) == pytest.approx(0.5)


def test_gpu_check_without_a_gpu_exits_with_a_clear_message() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--steps", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "no CUDA GPU is visible" in result.stderr and "Traceback" not in result.stderr
