"""The one mapping between megatron-core `GPTModel` parameters and Hugging Face Qwen2 tensors.

Every conversion in the project goes through this module: the offline HF <-> Megatron converter, checkpoint
export from torch_dist, and the live weight sync from the trainer to SGLang. It imports only torch and the
standard library so it runs where megatron-core is not installed.

Notation in shapes: L layers, H hidden, F ffn hidden (HF intermediate_size), nh attention heads, ng query
groups (HF num_key_value_heads), d head dim, hpg = nh // ng, V vocab, Vp Megatron's padded vocab.

Canonical Megatron names are megatron-core's local-spec in-memory names with the GLOBAL layer index:

    embedding.word_embeddings.weight                      [Vp, H]          model.embed_tokens.weight [V, H]
    decoder.layers.{i}.input_layernorm.weight             [H]              ...input_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv.weight   [(nh+2ng)d, H]   ...self_attn.{q,k,v}_proj.weight
    decoder.layers.{i}.self_attention.linear_qkv.bias     [(nh+2ng)d]      ...self_attn.{q,k,v}_proj.bias
    decoder.layers.{i}.self_attention.linear_proj.weight  [H, nh d]        ...self_attn.o_proj.weight
    decoder.layers.{i}.pre_mlp_layernorm.weight           [H]              ...post_attention_layernorm.weight
    decoder.layers.{i}.mlp.linear_fc1.weight              [2F, H]          ...mlp.{gate,up}_proj.weight
    decoder.layers.{i}.mlp.linear_fc2.weight              [H, F]           ...mlp.down_proj.weight
    decoder.final_layernorm.weight                        [H]              model.norm.weight
    output_layer.weight (absent when tied)                [Vp, H]          lm_head.weight [V, H]

Megatron interleaves q, k and v by query group: the rows of linear_qkv are
[q(g0, heads 0..hpg-1), k(g0), v(g0), q(g1, ...), k(g1), v(g1), ...], d rows per head. This is what lets each
tensor-parallel rank hold whole query groups with a plain row split.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dapo_megatron.models.config import ModelConfig


class _Fusion(enum.Enum):
    """How one Megatron tensor relates to its HF tensors."""

    NONE = "same tensor"
    QKV = "q, k, v interleaved by query group on dim 0"
    GATE_UP = "[gate; up] on dim 0"
    VOCAB = "vocab rows padded with zeros to Vp"


@dataclass(frozen=True)
class _Rule:
    hf: tuple[str, ...]
    """HF names (after `model.layers.{i}.` for per-layer parameters), in the order they are fused."""
    fusion: _Fusion
    tp_dim: int | None
    """Dimension split across tensor-parallel ranks (0 column-parallel, 1 row-parallel, None replicated)."""


_QKV_BIAS = "self_attention.linear_qkv.bias"
_FC1 = "mlp.linear_fc1.weight"
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT_LAYER = "output_layer.weight"

_LAYER_RULES: dict[str, _Rule] = {
    "input_layernorm.weight": _Rule(("input_layernorm.weight",), _Fusion.NONE, None),
    "self_attention.linear_qkv.weight": _Rule(
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), _Fusion.QKV, 0
    ),
    _QKV_BIAS: _Rule(
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), _Fusion.QKV, 0
    ),
    "self_attention.linear_proj.weight": _Rule(("self_attn.o_proj.weight",), _Fusion.NONE, 1),
    "pre_mlp_layernorm.weight": _Rule(("post_attention_layernorm.weight",), _Fusion.NONE, None),
    _FC1: _Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), _Fusion.GATE_UP, 0),
    "mlp.linear_fc2.weight": _Rule(("mlp.down_proj.weight",), _Fusion.NONE, 1),
}
_MODEL_RULES: dict[str, _Rule] = {
    _EMBEDDING: _Rule(("model.embed_tokens.weight",), _Fusion.VOCAB, 0),
    "decoder.final_layernorm.weight": _Rule(("model.norm.weight",), _Fusion.NONE, None),
    _OUTPUT_LAYER: _Rule(("lm_head.weight",), _Fusion.VOCAB, 0),
}
# Transformer Engine fuses the pre-attention / pre-MLP norms into the next linear layer; torch_dist
# checkpoints use these names even for local-spec models.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_FROM_TE_NORM_NAMES = {te: local for local, te in _TE_NORM_NAMES.items()}

_EXTRA_STATE = re.compile(r"(^|\.)_extra_state(/|$)")
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LAYER_INDEX = re.compile(r"(?<![^.])decoder\.layers\.(\d+)\.")  # at the start or after a wrapper prefix
_STACKED_LAYER_NAME = re.compile(r"decoder\.layers\.(\D.*)")  # torch_dist: no index, layers on axis 0
_TORCH_DIST_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_HF_HINT = "check that the ModelConfig matches the checkpoint's config.json (ModelConfig.from_hf_config)"
_MEGATRON_HINT = (
    "pass every parameter of the full model: TP-gathered tensors from all pipeline stages, "
    "with global layer indices (local_to_global_name)"
)


# ---------------------------------------------------------------- names and shapes


def canonical_megatron_name(name: str) -> str | None:
    """The canonical name of a Megatron state-dict entry, or None for entries that are not weights.

    Strips `module.` wrappers (DDP, Float16Module), renames the Transformer Engine fused-norm names to the
    local-spec names, and returns None for `_extra_state` (TE FP8 metadata, None in the local spec), also in
    torch_dist's form with a shard suffix (`linear_proj._extra_state/shard_0_8`).
    """
    while name.startswith("module."):
        name = name.removeprefix("module.")
    if _EXTRA_STATE.search(name):
        return None
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        return name
    return f"decoder.layers.{match[1]}.{_FROM_TE_NORM_NAMES.get(match[2], match[2])}"


def megatron_param_names(cfg: ModelConfig) -> list[str]:
    """Canonical names of every parameter of the full model, in model order."""
    names = [_EMBEDDING]
    names += [f"decoder.layers.{i}.{key}" for i in range(cfg.num_layers) for key in _layer_keys(cfg)]
    names.append("decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        names.append(_OUTPUT_LAYER)
    return names


def hf_param_names(cfg: ModelConfig) -> list[str]:
    """HF Qwen2 parameter names of the full model (no `lm_head.weight` when tied)."""
    return [hf for name in megatron_param_names(cfg) for hf in _resolve(name, cfg)[1]]


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF Qwen2 parameter name and its shape."""
    return {name: _hf_shape(name, cfg) for name in hf_param_names(cfg)}


def megatron_param_shapes(cfg: ModelConfig, tensor_parallel_size: int = 1) -> dict[str, tuple[int, ...]]:
    """Every canonical Megatron parameter name and its full (TP-unsharded) shape, with the vocab padded
    for this TP size."""
    return _megatron_shapes(cfg, cfg.padded_vocab_size(tensor_parallel_size))


def _megatron_shapes(cfg: ModelConfig, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    return {
        name: _megatron_shape(*_resolve(name, cfg), cfg, padded_vocab) for name in megatron_param_names(cfg)
    }


def _layer_keys(cfg: ModelConfig) -> list[str]:
    return [key for key in _LAYER_RULES if cfg.add_qkv_bias or key != _QKV_BIAS]


def _hf_shape(hf_name: str, cfg: ModelConfig) -> tuple[int, ...]:
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
    by_suffix = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    # "model.layers.{i}.<suffix>".split(".", 3)[3] is the per-layer suffix.
    return by_suffix[hf_name.split(".", 3)[3] if hf_name.startswith("model.layers.") else hf_name]


def _megatron_shape(
    rule: _Rule, hf_names: tuple[str, ...], cfg: ModelConfig, padded_vocab: int
) -> tuple[int, ...]:
    parts = [_hf_shape(hf, cfg) for hf in hf_names]
    if rule.fusion is _Fusion.VOCAB:
        return (padded_vocab, *parts[0][1:])
    return (sum(part[0] for part in parts), *parts[0][1:])  # QKV and GATE_UP stack their parts on dim 0


def _vocab_rows(table: Tensor | None, cfg: ModelConfig) -> int:
    """The padded vocab size of a Megatron embedding or output layer. Any padding >= V is accepted, as it
    depends on the TP size the model was built with; otherwise the TP=1 size, which fails the shape check."""
    rows = table.shape[0] if table is not None and table.dim() else 0
    return rows if rows >= cfg.vocab_size else cfg.padded_vocab_size(1)


def _rule(canonical: str) -> tuple[_Rule, int | None]:
    """The rule of a canonical name and its layer index (None outside the decoder layers)."""
    match = _LAYER_NAME.fullmatch(canonical)
    rule = _MODEL_RULES.get(canonical) if match is None else _LAYER_RULES.get(match[2])
    if rule is None:
        layer_keys = ", ".join(_LAYER_RULES)
        raise ValueError(
            f"{canonical!r} is not a Qwen2 GPTModel parameter that this mapping knows "
            f"(known: {sorted(_MODEL_RULES)} and decoder.layers.{{i}}.{{{layer_keys}}})."
        )
    return rule, None if match is None else int(match[1])


def _resolve(canonical: str, cfg: ModelConfig) -> tuple[_Rule, tuple[str, ...]]:
    """The rule of a canonical Megatron name and its full HF names, checked against the config."""
    rule, layer = _rule(canonical)
    if layer is not None and layer >= cfg.num_layers:
        raise ValueError(
            f"{canonical!r}: layer {layer} does not exist in a {cfg.num_layers}-layer model; "
            "names must carry global layer indices (local_to_global_name)."
        )
    if canonical.endswith(_QKV_BIAS) and not cfg.add_qkv_bias:
        raise ValueError(
            f"{canonical!r} exists but model.add_qkv_bias is False; set it to True (Qwen2 has QKV bias)."
        )
    prefix = "" if layer is None else f"model.layers.{layer}."
    return rule, tuple(prefix + hf for hf in rule.hf)


# ---------------------------------------------------------------- Megatron <-> HF


def megatron_to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    """One full (TP-unsharded) Megatron parameter with a global layer index -> its HF tensors.

    `name` may carry `module.` prefixes and TE norm names. Returns [] for `_extra_state` entries and, when
    embeddings are tied, for `output_layer.weight` (the last pipeline stage's replica of the embedding).

    linear_qkv [(nh+2ng)d, H] -> q_proj [nh d, H], k_proj [ng d, H], v_proj [ng d, H] (bias: no H axis);
    linear_fc1 [2F, H] -> gate_proj [F, H], up_proj [F, H]; embedding/output layer [Vp, H] -> [V, H].
    Results are views of `tensor` (no copy), except q/k/v when ng > 1: their rows are scattered across the
    groups, so each is one copy.
    """
    canonical = canonical_megatron_name(name)
    if canonical is None or (canonical == _OUTPUT_LAYER and cfg.tie_word_embeddings):
        return []
    rule, hf_names = _resolve(canonical, cfg)
    expected = _megatron_shape(rule, hf_names, cfg, _vocab_rows(tensor, cfg))
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"Megatron tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}; "
            "pass the full (TP-gathered) tensor of a model built with this ModelConfig."
        )
    return list(zip(hf_names, _split(rule.fusion, tensor, cfg), strict=True))


def _split(fusion: _Fusion, tensor: Tensor, cfg: ModelConfig) -> list[Tensor]:
    if fusion is _Fusion.NONE:
        return [tensor]
    if fusion is _Fusion.VOCAB:
        return [tensor[: cfg.vocab_size]]
    if fusion is _Fusion.GATE_UP:
        return list(tensor.chunk(2))
    d, hpg = cfg.head_dim, cfg.num_attention_heads // cfg.num_query_groups
    groups = tensor.unflatten(0, (cfg.num_query_groups, (hpg + 2) * d))
    return [part.flatten(0, 1) for part in groups.split([hpg * d, d, d], dim=1)]


def _merge(fusion: _Fusion, parts: list[Tensor], rows: int, groups: int) -> Tensor:
    """Fuse HF tensors (or the slices of them one TP rank holds) into one Megatron tensor (or its shard):
    `rows` is the padded vocab rows to fill, `groups` the query groups that `parts` cover."""
    if fusion is _Fusion.NONE:
        return parts[0]
    if fusion is _Fusion.VOCAB:
        (table,) = parts
        return torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])
    if fusion is _Fusion.GATE_UP:
        return torch.cat(parts)
    return torch.cat([part.unflatten(0, (groups, -1)) for part in parts], dim=1).flatten(0, 1)


def hf_to_megatron(
    hf_state: Mapping[str, Tensor], cfg: ModelConfig, *, tensor_parallel_size: int = 1
) -> dict[str, Tensor]:
    """A full HF Qwen2 state dict -> full (TP-unsharded) Megatron tensors under canonical names.

    The embedding and output layer get zero rows up to `cfg.padded_vocab_size(tensor_parallel_size)` (the
    only effect of the TP size here; shard with `shard_for_tensor_parallel`). Fused and padded tensors are
    new; the others are the input tensors themselves. With tied embeddings an `lm_head.weight` equal to
    `embed_tokens` (transformers' state_dict includes it) is ignored; a different one is an error.
    Raises ValueError listing missing and unexpected names and shape mismatches.
    """
    hf_state = dict(hf_state)
    if cfg.tie_word_embeddings and "lm_head.weight" in hf_state:
        lm_head, embed = hf_state.pop("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
        if embed is not None and lm_head is not embed and not torch.equal(lm_head, embed):
            raise ValueError(
                "lm_head.weight differs from model.embed_tokens.weight but "
                "model.tie_word_embeddings is True; set it to False to keep a separate "
                "output layer."
            )
    check_hf_shapes({name: tuple(tensor.shape) for name, tensor in hf_state.items()}, cfg)
    padded_vocab = cfg.padded_vocab_size(tensor_parallel_size)
    megatron = {}
    for name in megatron_param_names(cfg):
        rule, hf_names = _resolve(name, cfg)
        megatron[name] = _merge(
            rule.fusion, [hf_state[hf] for hf in hf_names], padded_vocab, cfg.num_query_groups
        )
    return megatron


def megatron_state_to_hf(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A full Megatron state dict (any wrapper prefix, TE or local names) -> the HF Qwen2 state dict.

    Views where `megatron_to_hf` gives views. Raises ValueError listing missing and unexpected parameters and
    shape mismatches.
    """
    return {
        hf: tensor
        for name, full in _checked_megatron_state(state, cfg).items()
        for hf, tensor in megatron_to_hf(name, full, cfg)
    }


def _checked_megatron_state(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """`state` under canonical names, without non-weights and the tied output-layer replica, validated."""
    canonical = {}
    for name, tensor in state.items():
        key = canonical_megatron_name(name)
        if key is not None and not (key == _OUTPUT_LAYER and cfg.tie_word_embeddings):
            canonical[key] = tensor
    expected = _megatron_shapes(cfg, _vocab_rows(canonical.get(_EMBEDDING), cfg))
    _check_state(
        {name: tuple(tensor.shape) for name, tensor in canonical.items()},
        expected,
        "Megatron",
        _MEGATRON_HINT,
    )
    return canonical


def check_hf_shapes(shapes: Mapping[str, tuple[int, ...]], cfg: ModelConfig) -> None:
    """Raise ValueError naming every missing, unexpected and wrongly shaped tensor of a Hugging Face
    checkpoint, given its tensors' shapes. With tied embeddings an `lm_head.weight` is ignored."""
    if cfg.tie_word_embeddings:
        shapes = {name: shape for name, shape in shapes.items() if name != "lm_head.weight"}
    _check_state(shapes, hf_param_shapes(cfg), "Hugging Face", _HF_HINT)


def _check_state(
    shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], kind: str, hint: str
) -> None:
    """Raise one ValueError naming every missing, unexpected and wrongly shaped tensor."""
    missing = [name for name in expected if name not in shapes]
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [
        f"{name}: expected {expected[name]}, got {shapes[name]}"
        for name in expected
        if name in shapes and tuple(shapes[name]) != expected[name]
    ]
    if not (missing or unexpected or wrong):
        return
    problems = [
        f"{label} ({len(items)}):\n  " + "\n  ".join(items)
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if items
    ]
    raise ValueError(f"{kind} state dict does not match the model config; {hint}.\n" + "\n".join(problems))


# ---------------------------------------------------------------- tensor parallelism


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension megatron-core splits across TP ranks: 0 for column-parallel (linear_qkv, linear_fc1,
    word embeddings, output layer), 1 for row-parallel (linear_proj, linear_fc2), None for replicated
    norms."""
    canonical = canonical_megatron_name(name)
    if canonical is None:
        raise ValueError(f"{name!r} is not a weight (extra state has no tensor-parallel layout).")
    return _rule(canonical)[0].tp_dim


def validate_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ValueError unless megatron-core can split this model over `tensor_parallel_size` ranks."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1; got {tensor_parallel_size}.")
    # Each rank holds whole query groups (linear_qkv is split by rows), whole heads and an equal slice of F.
    sizes = {
        "num_query_groups": cfg.num_query_groups,
        "num_attention_heads": cfg.num_attention_heads,
        "ffn_hidden_size": cfg.ffn_hidden_size,
    }
    bad = [f"model.{field} ({value})" for field, value in sizes.items() if value % tensor_parallel_size]
    if bad:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} does not divide {', '.join(bad)}; "
            "use a tensor-parallel size that divides all of them."
        )


def shard_for_tensor_parallel(
    name: str, full: Tensor, cfg: ModelConfig, tp_size: int, tp_rank: int
) -> Tensor:
    """The slice of one full Megatron parameter held by TP rank `tp_rank` of `tp_size`, in megatron-core's
    layout.

    Column-parallel [R, ...] -> [R/tp, ...]; row-parallel [H, C] -> [H, C/tp]; norms are returned whole.
    linear_fc1 [2F, H] -> [gate_r; up_r] [2F/tp, H], a new tensor; all other results are views of `full`.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}); got {tp_rank}.")
    dim = tensor_parallel_dim(name)
    if dim is None:
        return full
    try:
        validate_tensor_parallel(cfg, tp_size)
    except ValueError as error:
        raise ValueError(f"cannot shard {name!r}: {error}") from None
    if full.shape[dim] % tp_size:
        raise ValueError(
            f"cannot shard {name!r} of shape {tuple(full.shape)} over {tp_size} ranks on "
            f"dim {dim}; pad the vocab with cfg.padded_vocab_size(tp_size) "
            "(hf_to_megatron does)."
        )
    if name.endswith(_FC1):
        # Megatron chunks gate and up separately so that each rank can apply SwiGLU to its own slice.
        return torch.cat([half.chunk(tp_size)[tp_rank] for half in full.chunk(2)])
    size = full.shape[dim] // tp_size
    return full.narrow(dim, tp_rank * size, size)


def gather_tensor_parallel(name: str, shards: Sequence[Tensor]) -> Tensor:
    """The full Megatron parameter from the shards of all TP ranks, in rank order (inverse of
    `shard_for_tensor_parallel`). linear_fc1 shards [gate_r; up_r] are split and regrouped to
    [gate_0..gate_{tp-1}; up_0..up_{tp-1}]: concatenating them as they are would mix gate and up rows.
    Returns a new tensor, or `shards[0]` for replicated norms."""
    if not shards:
        raise ValueError(f"no shards given for {name!r}.")
    dim = tensor_parallel_dim(name)
    if dim is None:
        return shards[0]
    if name.endswith(_FC1):
        gates, ups = zip(*(shard.chunk(2) for shard in shards), strict=True)
        return torch.cat([*gates, *ups])
    return torch.cat(list(shards), dim=dim)


@dataclass(frozen=True)
class HFSlice:
    """Indices [start, stop) of the Hugging Face tensor `name` along `dim`; the whole tensor when `dim` is
    None."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


def hf_slices_for_shard(name: str, cfg: ModelConfig, tp_size: int, tp_rank: int) -> list[HFSlice]:
    """The parts of HF tensors that TP rank `tp_rank` needs for its shard of the canonical Megatron
    parameter `name`, and nothing more; `shard_from_hf_slices` assembles them.

    linear_qkv: per owned query group, its q/k/v rows, i.e. one row range of each of q_proj, k_proj, v_proj;
    linear_fc1: the same row range of gate_proj and up_proj; linear_proj / linear_fc2: a column range;
    embedding / output layer: the rank's vocab rows that exist in HF (the padding rows are zeros).
    """
    rule, hf_names = _resolve(name, cfg)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}); got {tp_rank}.")
    if rule.tp_dim is None:
        return [HFSlice(hf) for hf in hf_names]
    try:
        validate_tensor_parallel(cfg, tp_size)
    except ValueError as error:
        raise ValueError(f"cannot shard {name!r}: {error}") from None
    if rule.fusion is _Fusion.VOCAB:
        rows = cfg.padded_vocab_size(tp_size) // tp_size
        start, stop = (min(row, cfg.vocab_size) for row in (tp_rank * rows, (tp_rank + 1) * rows))
        return [HFSlice(hf_names[0], 0, start, stop)]
    if rule.fusion is _Fusion.QKV:
        groups, hpg = cfg.num_query_groups // tp_size, cfg.num_attention_heads // cfg.num_query_groups
        rows = [hpg * cfg.head_dim * groups, cfg.head_dim * groups, cfg.head_dim * groups]
        return [
            HFSlice(hf, 0, tp_rank * size, (tp_rank + 1) * size)
            for hf, size in zip(hf_names, rows, strict=True)
        ]
    size = _hf_shape(hf_names[0], cfg)[rule.tp_dim] // tp_size
    return [HFSlice(hf, rule.tp_dim, tp_rank * size, (tp_rank + 1) * size) for hf in hf_names]


def shard_from_hf_slices(name: str, parts: Sequence[Tensor], cfg: ModelConfig, tp_size: int) -> Tensor:
    """TP shard of the canonical Megatron parameter `name` from the HF slices `hf_slices_for_shard` named,
    read in its order. Equal to `shard_for_tensor_parallel` of the full `hf_to_megatron` tensor."""
    rule, _ = _rule(name)
    return _merge(
        rule.fusion, list(parts), cfg.padded_vocab_size(tp_size) // tp_size, cfg.num_query_groups // tp_size
    )


# ---------------------------------------------------------------- pipeline parallelism


def layer_range(cfg: ModelConfig, pp_size: int, pp_rank: int) -> range:
    """Global indices of the decoder layers held by pipeline stage `pp_rank` (megatron-core's default even
    split; uneven first/last stages and virtual pipeline stages are not supported)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}); got {pp_rank}.")
    if cfg.num_layers % pp_size:
        raise ValueError(
            f"model.num_layers ({cfg.num_layers}) is not divisible by the pipeline-parallel "
            f"size ({pp_size}); choose a size that divides it."
        )
    per_stage = cfg.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def local_to_global_name(name: str, layer_offset: int) -> str:
    """`decoder.layers.{j}.` -> `decoder.layers.{j + layer_offset}.` (layer_offset = layer_range(...).start);
    other names and any wrapper prefix are kept."""
    return _shift_layer_index(name, layer_offset)


def global_to_local_name(name: str, layer_offset: int) -> str:
    """Inverse of `local_to_global_name`."""
    return _shift_layer_index(name, -layer_offset)


def _shift_layer_index(name: str, shift: int) -> str:
    def shifted(match: re.Match[str]) -> str:
        index = int(match[1]) + shift
        if index < 0:
            raise ValueError(f"{name!r}: layer {match[1]} is before this stage's first layer ({-shift}).")
        return f"decoder.layers.{index}."

    return _LAYER_INDEX.sub(shifted, name, count=1)


# ---------------------------------------------------------------- torch_dist checkpoints


def unstack_torch_dist(flat: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Model tensors of a flattened torch_dist checkpoint -> canonical per-layer names (views).

    torch_dist keys use the TE names with the layers stacked on a new axis 0
    (`decoder.layers.mlp.linear_fc1.weight` [L, 2F, H], fc1 as [gate_full; up_full] whatever the TP size);
    per-layer keys (`non_homogeneous_layers`) are accepted too. Optimizer state, RNG state and `_extra_state`
    entries are dropped. Raises ValueError if the model tensors do not match `cfg`.
    """
    state = {}
    for key, value in flat.items():
        if not key.startswith(_TORCH_DIST_MODEL_PREFIXES) or canonical_megatron_name(key) is None:
            continue
        stacked = _STACKED_LAYER_NAME.fullmatch(key)
        if stacked is None:
            state[key] = value
            continue
        if value.shape[0] != cfg.num_layers:
            raise ValueError(
                f"torch_dist tensor {key!r} stacks {value.shape[0]} layers; the config has {cfg.num_layers}."
            )
        state.update({f"decoder.layers.{i}.{stacked[1]}": layer for i, layer in enumerate(value.unbind(0))})
    return _checked_megatron_state(state, cfg)


def stack_for_torch_dist(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A full Megatron state dict -> torch_dist's model keys (TE names, layers stacked on axis 0; new
    tensors)."""
    canonical = _checked_megatron_state(state, cfg)
    flat = {name: tensor for name, tensor in canonical.items() if _LAYER_NAME.fullmatch(name) is None}
    for key in _layer_keys(cfg):
        layers = [canonical[f"decoder.layers.{i}.{key}"] for i in range(cfg.num_layers)]
        flat[f"decoder.layers.{_TE_NORM_NAMES.get(key, key)}"] = torch.stack(layers)
    return flat
