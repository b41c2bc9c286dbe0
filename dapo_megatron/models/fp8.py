"""FP8 training with Transformer Engine: the `model.fp8` settings, their mapping onto megatron-core's
TransformerConfig fields, and the checks that turn "FP8 cannot run here" into a message naming the fix.

FP8 is GPU-only: TE cannot be installed against a CPU torch, and FP8 tensor cores start with Hopper
(compute capability 9.0; MXFP8 needs Blackwell, 10.0). megatron-core does the work once
`TransformerConfig.fp8` is set and the TE layer spec is used: `TransformerBlock` enters TE's
`fp8_autocast` around the layers, with per-layer contexts when the first/last layers stay in bf16.

Everything here except `detect_environment` is pure and imports nothing heavy, so the config layer and
the CPU tests use it without torch or TE. The environment checks take their inputs as arguments
(`Fp8Environment`): tests describe "no TE", "no CUDA" or "an A100" instead of patching torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dapo_megatron import backends
from dapo_megatron.versions import package_version

FP8_FORMATS = ("hybrid", "e4m3")
"""`hybrid`: e4m3 forward, e5m2 for gradients (the usual training choice); `e4m3` everywhere."""

FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
"""megatron-core 0.16.1's built-in scaling recipes (its `custom` recipe needs user code and is not
offered)."""

MIN_TE_VERSION = {"delayed": (1, 0), "tensorwise": (2, 2), "blockwise": (2, 3), "mxfp8": (2, 1)}
"""TE versions from which megatron-core 0.16.1 builds each recipe (`fp8_utils.get_fp8_recipe`)."""

MIN_COMPUTE_CAPABILITY = {"delayed": (9, 0), "tensorwise": (9, 0), "blockwise": (9, 0), "mxfp8": (10, 0)}
"""FP8 tensor cores: Hopper (9.0) and newer; MXFP8's block scales are a Blackwell (10.0) format."""


@dataclass
class Fp8Config:
    """`model.fp8`: FP8 matmuls in the transformer layers through Transformer Engine (GPU only)."""

    enabled: bool = False
    format: str = "hybrid"
    """One of FP8_FORMATS."""
    recipe: str = "tensorwise"
    """How scales are chosen, one of FP8_RECIPES. `tensorwise` (current scaling: the scale comes from this
    step's own amax) keeps the trainer closest to bf16, which matters in RL where the ratio to the rollout
    policy is the signal; `delayed` uses an amax history; `blockwise` scales 128-wide blocks (DeepSeek-V3
    style); `mxfp8` scales 32-element blocks (Blackwell only)."""
    margin: int = 0
    """Scale = (fp8 max / amax) / 2^margin (delayed scaling)."""
    amax_history_len: int = 1024
    """Steps of amax history for delayed scaling (NVIDIA's H100 FP8 recipes use 1024 with `max`)."""
    amax_compute_algo: str = "max"
    """`max` or `most_recent` over the history (delayed scaling)."""
    param_gather: bool = False
    """Keep the layer weights in FP8 and all-gather them in FP8 (megatron-core's `fp8_param` +
    `fp8_param_gather`): less memory and half the gather traffic. Needs the distributed optimizer,
    which keeps the fp32 master weights."""
    first_last_layers_bf16: bool = False
    """Keep the first / last layers in bf16 (the most sensitive ones). Not with delayed scaling."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    def __post_init__(self) -> None:
        if self.format not in FP8_FORMATS:
            raise ValueError(
                f"model.fp8.format must be one of {', '.join(FP8_FORMATS)}; got {self.format!r}."
            )
        if self.recipe not in FP8_RECIPES:
            raise ValueError(
                f"model.fp8.recipe must be one of {', '.join(FP8_RECIPES)}; got {self.recipe!r}."
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"model.fp8.amax_compute_algo must be max or most_recent; got {self.amax_compute_algo!r}."
            )
        if self.amax_history_len < 1 or self.margin < 0:
            raise ValueError(
                "model.fp8.amax_history_len must be >= 1 and model.fp8.margin >= 0; got "
                f"{self.amax_history_len}, {self.margin}."
            )
        if self.num_layers_at_start_in_bf16 < 0 or self.num_layers_at_end_in_bf16 < 0:
            raise ValueError(
                "model.fp8.num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 must be >= 0."
            )
        if self.first_last_layers_bf16 and self.recipe == "delayed":
            # megatron-core enters the FP8 context once around all layers for delayed scaling (per-layer
            # contexts would break its amax reduction), so it cannot leave some layers out.
            raise ValueError(
                "model.fp8.first_last_layers_bf16=true does not work with model.fp8.recipe=delayed; "
                "use recipe=tensorwise or blockwise, or first_last_layers_bf16=false."
            )

    @property
    def gemm_alignment(self) -> int:
        """Every FP8 GEMM dimension must be a multiple of this (megatron-core `get_fp8_align_size`)."""
        return 32 if self.recipe == "mxfp8" else 16


def transformer_config_kwargs(fp8: Fp8Config) -> dict[str, Any]:
    """megatron-core TransformerConfig fields for these settings (nothing when FP8 is off, so the bf16
    config is exactly megatron-core's defaults)."""
    if not fp8.enabled:
        return {}
    return {
        "fp8": fp8.format,
        "fp8_recipe": fp8.recipe,
        "fp8_margin": fp8.margin,
        "fp8_amax_history_len": fp8.amax_history_len,
        "fp8_amax_compute_algo": fp8.amax_compute_algo,
        "fp8_param": fp8.param_gather,
        "first_last_layers_bf16": fp8.first_last_layers_bf16,
        "num_layers_at_start_in_bf16": fp8.num_layers_at_start_in_bf16,
        "num_layers_at_end_in_bf16": fp8.num_layers_at_end_in_bf16,
    }


def alignment_error(
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int,
    tensor_parallel_size: int,
    fp8: Fp8Config,
) -> str | None:
    """Why these shapes cannot run FP8 GEMMs at this TP size, or None when they can.

    Each linear layer's input and output widths on one TP rank must be multiples of the GEMM alignment.
    The output layer is not checked: it runs outside megatron-core's FP8 context.
    """
    if not fp8.enabled:
        return None

    def misaligned(tp: int) -> tuple[str, int] | None:
        query, key_value = num_attention_heads * head_dim, num_query_groups * head_dim
        widths = {
            "model.hidden_size": hidden_size,
            "the QKV projection width per TP rank ((heads + 2 x query groups) x head_dim / TP)": (
                query + 2 * key_value
            )
            // tp,
            "the attention output width per TP rank (heads x head_dim / TP)": query // tp,
            "model.ffn_hidden_size / TP": ffn_hidden_size // tp,
        }
        return next(((name, width) for name, width in widths.items() if width % fp8.gemm_alignment), None)

    tp = tensor_parallel_size
    problem = misaligned(tp)
    if problem is None:
        return None
    fitting = [size for size in range(1, tp) if tp % size == 0 and misaligned(size) is None]
    fix = f"Use parallel.tensor_model_parallel_size={fitting[-1]}" if fitting else "Use another model"
    return (
        f"model.fp8.enabled=true needs every FP8 GEMM width to be a multiple of {fp8.gemm_alignment} "
        f"(model.fp8.recipe={fp8.recipe}); {problem[0]} = {problem[1]} at "
        f"parallel.tensor_model_parallel_size={tp}. {fix} or set model.fp8.enabled=false."
    )


@dataclass(frozen=True)
class Fp8Environment:
    """What FP8 depends on in this process. `detect_environment()` fills it in; tests describe one."""

    te_version: tuple[int, int] | None
    """Transformer Engine's (major, minor), None when it is not installed."""
    cuda_available: bool
    device_name: str | None = None
    compute_capability: tuple[int, int] | None = None


@contextlib.contextmanager
def compute_off(config: Any) -> Iterator[None]:
    """The policy's forward passes in its weights' dtype for the duration: megatron-core reads
    `TransformerConfig.fp8` at each forward (`get_fp8_context`), so with it cleared the TE layers run no FP8
    GEMM. For the weight-sync check: the engine holds the bf16 weights the trainer sent, and an FP8 forward
    differs from them by FP8's rounding, which would hide a missing weight under a tolerance loose enough for
    it, or fail a bf16 tolerance with every weight in place."""
    saved = config.fp8
    config.fp8 = None
    try:
        yield
    finally:
        config.fp8 = saved


def detect_environment() -> Fp8Environment:
    installed = package_version("TE")
    # "unknown": a source build with neither metadata nor __version__; FP8 then refuses with the reason.
    te_version = _major_minor(installed) if installed and installed != "unknown" else None
    backend = backends.detect()
    device_name = backend.device_name()
    if device_name is None:
        return Fp8Environment(te_version=te_version, cuda_available=False)
    return Fp8Environment(
        te_version=te_version,
        cuda_available=True,
        device_name=device_name,
        compute_capability=backend.device_capability(),
    )


def check_environment(fp8: Fp8Config, env: Fp8Environment, *, transformer_impl: str) -> None:
    """Raise RuntimeError naming what is missing when these FP8 settings cannot run here."""
    if not fp8.enabled:
        return
    off = "or set model.fp8.enabled=false"
    if transformer_impl == "local":
        raise RuntimeError(
            "model.fp8.enabled=true needs Transformer Engine layers, but model.transformer_impl=local; "
            f"set model.transformer_impl=auto (or transformer_engine) {off}."
        )
    if not env.cuda_available:
        raise RuntimeError(
            f"model.fp8.enabled=true needs a CUDA GPU (Hopper or newer); this machine has none. "
            f"Run on a GPU node {off}."
        )
    if env.te_version is None:
        raise RuntimeError(
            "model.fp8.enabled=true needs Transformer Engine, which is not installed. Run inside "
            f"the project's cluster image (slurm/Dockerfile) {off}."
        )
    needed_te = MIN_TE_VERSION[fp8.recipe]
    if env.te_version < needed_te:
        raise RuntimeError(
            f"model.fp8.recipe={fp8.recipe} needs Transformer Engine >= {_dotted(needed_te)}; "
            f"this one is {_dotted(env.te_version)}. Use a newer container or model.fp8.recipe=delayed, "
            f"{off}."
        )
    needed_cc = MIN_COMPUTE_CAPABILITY[fp8.recipe]
    if env.compute_capability is None or env.compute_capability < needed_cc:
        generation = "Blackwell" if needed_cc >= (10, 0) else "Hopper"
        alternative = "model.fp8.recipe=tensorwise on Hopper, " if fp8.recipe == "mxfp8" else ""
        raise RuntimeError(
            f"model.fp8.recipe={fp8.recipe} needs a {generation} or newer GPU (compute capability >= "
            f"{_dotted(needed_cc)}); {env.device_name} has {_dotted(env.compute_capability)}. "
            f"Use {alternative}a newer GPU {off}."
        )


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _dotted(version: tuple[int, int] | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))
