"""The policy model's configuration: the shapes of a Qwen2-family decoder and how to build it.

Plain dataclass with OmegaConf-compatible fields so Hydra can use it as a structured-config schema
(`configs/model/*.yaml`). It imports nothing heavy: the HF mapping and the tools read it without
megatron installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dapo_megatron.models.fp8 import Fp8Config


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Human-readable name, used in logs and checkpoint metadata."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    """HF `intermediate_size` (the SwiGLU width, before the gate/up fusion)."""
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """HF `num_key_value_heads` (grouped-query attention)."""
    kv_channels: int | None = None
    """Head dimension; None means hidden_size // num_attention_heads (as in HF Qwen2)."""
    vocab_size: int = 256
    """HF `vocab_size` (rows of embed_tokens). Megatron pads it, see `padded_vocab_size`."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocab to a multiple of this times the tensor-parallel size."""
    max_position_embeddings: int = 4096
    rotary_base: float = 1000000.0
    """HF `rope_theta`."""
    norm_epsilon: float = 1e-6
    """HF `rms_norm_eps`."""
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = True
    params_dtype: str = "bfloat16"
    """One of float32, bfloat16, float16. CPU tests use float32."""
    transformer_impl: str = "auto"
    """`local` (megatron-core's torch layers), `transformer_engine`, or `auto` (TE when CUDA and TE exist)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 Transformer Engine layers (GPU only, off by default); see `models/fp8.py`."""
    hf_dir: str | None = None
    """Hugging Face directory (config + tokenizer, optionally weights) the policy starts from."""

    def __post_init__(self) -> None:
        if isinstance(self.fp8, dict):  # read back from a checkpoint's JSON (checkpoint.read_model_config)
            self.fp8 = Fp8Config(**self.fp8)
        positive = (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vocab_size",
            "make_vocab_size_divisible_by",
            "max_position_embeddings",
        )
        for field_name in positive:
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{field_name} must be a positive integer; got {value!r}.")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.num_query_groups}) for grouped-query attention."
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) is not divisible by model.num_attention_heads "
                f"({self.num_attention_heads}); set model.kv_channels explicitly."
            )
        if self.params_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"model.params_dtype must be float32, bfloat16 or float16; got {self.params_dtype!r}."
            )
        if self.transformer_impl not in ("auto", "local", "transformer_engine"):
            raise ValueError(
                "model.transformer_impl must be auto, local or transformer_engine; "
                f"got {self.transformer_impl!r}."
            )
        if self.fp8.enabled and self.transformer_impl == "local":
            raise ValueError(
                "model.fp8.enabled=true needs Transformer Engine layers; set model.transformer_impl=auto "
                "(or transformer_engine) or model.fp8.enabled=false."
            )

    @property
    def head_dim(self) -> int:
        return (
            self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads
        )

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Rows of Megatron's embedding and output layer: the vocab rounded up to a multiple of
        lcm(`make_vocab_size_divisible_by`, TP), so every TP rank gets an equal slice.

        Unlike Megatron-LM's multiple of 128 x TP, this does not change with the TP size for the usual
        power-of-two layouts (lcm(128, 8) = 128), so one checkpoint loads under any of them; and Qwen's
        vocab sizes (151936, 152064) are already multiples of 128, so nothing is padded at all.
        """
        multiple = math.lcm(self.make_vocab_size_divisible_by, tensor_parallel_size)
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Parameters of the HF model (no vocab padding)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attention = h * (q + 2 * kv) + (q + 2 * kv) * self.add_qkv_bias + q * h
        per_layer = attention + 3 * h * f + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Build from a Hugging Face Qwen2 `config.json` dict."""
        if hf.get("model_type") not in (None, "qwen2"):
            raise ValueError(
                f"only Qwen2-family models are supported; config.json has "
                f"model_type={hf.get('model_type')!r}."
            )
        fields: dict[str, Any] = dict(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=hf["num_attention_heads"],
            num_query_groups=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            kv_channels=hf.get("head_dim"),
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            # transformers 5 writes rope_parameters.rope_theta; older configs a top-level rope_theta.
            rotary_base=float(
                hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            ),
            norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face `config.json` fields that describe this architecture."""
        hf: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rotary_base,
            "rms_norm_eps": self.norm_epsilon,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "torch_dtype": self.params_dtype,
        }
        if self.kv_channels is not None:
            hf["head_dim"] = self.kv_channels
        return hf
