"""The small Qwen2-like model configurations the tests build: one tiny model whose shapes live here, so that a
test names only the sizes and settings it needs to differ. Light to import (no torch, no megatron), so the
worker scripts that torchrun starts (with the checkout on PYTHONPATH) use it too."""

from __future__ import annotations

from typing import Any

from dapo_megatron.models.config import ModelConfig

TINY_SHAPES: dict[str, int] = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
)
"""2 layers, hidden 64, 4 heads of 16 in 2 query groups, SwiGLU width 128, vocab 256."""


def small_model_config(**overrides: Any) -> ModelConfig:
    """The tiny test Qwen2 (`TINY_SHAPES`) with `overrides` applied; every field neither names keeps
    `ModelConfig`'s default (e.g. bfloat16, transformer_impl auto, 4096 positions)."""
    return ModelConfig(**{**TINY_SHAPES, **overrides})
