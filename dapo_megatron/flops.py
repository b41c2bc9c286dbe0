"""Model FLOPs and utilisation (MFU) of a training step: the numbers `tools/gpu_check.py` reports.

Training FLOPs of a decoder on one sequence of s tokens (the PaLM / Megatron-LM convention: matmuls only,
backward = 2 x forward, no credit for activation recompute, no causal-mask discount):

    6 x N x s  +  12 x L x (heads x head_dim) x s^2

N counts the parameters of every matmul a token goes through: per layer the QKV projection, the
attention output projection and the three SwiGLU matrices, plus the output layer (h x V). Embedding
lookups, norms and biases are not matmuls and are left out. The second term is attention itself: per
layer and token, QK^T and the weighted sum of V are 2 x 2 x s x (heads x head_dim) FLOPs forward, times 3.

MFU = achieved model FLOPs per second / (GPUs x the GPU's dense peak for the precision used).
"""

from __future__ import annotations

from collections.abc import Sequence

from dapo_megatron.models.config import ModelConfig

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Dense (no sparsity) tensor-core peaks from NVIDIA's data sheets. Matched against
    # torch.cuda.get_device_name() in this order, so the more specific names come first.
    "H100 PCIe": {"bf16": 756.0, "fp8": 1513.0},
    "H100 NVL": {"bf16": 835.0, "fp8": 1671.0},
    "H100": {"bf16": 989.0, "fp8": 1979.0},  # SXM5 ("NVIDIA H100 80GB HBM3")
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "H800": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0},
    "A100": {"bf16": 312.0},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of one GPU for `bf16` or `fp8` matmuls, None when the GPU is not in the table
    (or has no such tensor cores)."""
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks.get(precision)
    return None


def layer_weights(model: ModelConfig) -> list[tuple[int, int]]:
    """(fan-in, fan-out) of each matmul weight one layer applies to a token: the QKV projection, the attention
    output projection, SwiGLU's gate and up projections (one fused matrix) and its down projection."""
    h, f = model.hidden_size, model.ffn_hidden_size
    query, key_value = model.num_attention_heads * model.head_dim, model.num_query_groups * model.head_dim
    return [(h, query + 2 * key_value), (query, h), (h, 2 * f), (f, h)]


def matmul_parameters(model: ModelConfig) -> int:
    """N of the formula above: the weights of every matmul one token passes through."""
    per_layer = sum(fan_in * fan_out for fan_in, fan_out in layer_weights(model))
    return model.num_layers * per_layer + model.hidden_size * model.vocab_size


def training_flops(model: ModelConfig, sequence_lengths: Sequence[int]) -> float:
    """Model FLOPs of one forward + backward pass over sequences of these lengths."""
    n = matmul_parameters(model)
    attention_width = model.num_attention_heads * model.head_dim
    return float(sum(6 * n * s + 12 * model.num_layers * attention_width * s * s for s in sequence_lengths))


def mfu(flops: float, seconds: float, *, num_gpus: int, peak_tflops_per_gpu: float) -> float:
    """Fraction of the GPUs' peak that `flops` in `seconds` achieved."""
    return flops / seconds / (num_gpus * peak_tflops_per_gpu * 1e12)
