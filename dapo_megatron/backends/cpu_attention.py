"""Batched attention for SGLang's CPU engine: the `torch_native` backend without its per-sequence loop.

SGLang's torch_native backend runs one `scaled_dot_product_attention` call per sequence per layer, so a
decode step over 256 sequences is 256 tiny kernel launches per layer; profiling the demo's engine showed
that loop taking ~60% of the scheduler's time. Here every sequence's keys and values are gathered from
the KV cache into one padded batch and attention runs once per layer, with a mask for the padding (and
for causality in prefill). The arithmetic per sequence is the same, so outputs agree with the loop to
fp32 rounding (tests/integration check the engine's log-probs against the trainer's).

It is registered under the name `torch_native` through SGLang's own backend registry, so every other
place where SGLang special-cases that name (no CUDA graphs, no Triton kernels, KV-cache helpers) keeps
applying. Anything unusual (encoder-decoder, sliding windows, very large padded batches) goes to the
original per-sequence code. Only the CPU engine imports this (`backends/sglang_cpu.py`). Being the one
piece of this project that runs on every forward pass, it is also where the engine takes the intra-op
thread count the trainer asks for (`backends/engine_threads.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.attention_registry import register_attention_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention

from dapo_megatron.backends import engine_threads

MAX_PADDED_SCORES = 1 << 26
"""Above this many attention scores (sequences x heads x queries x keys) in one padded batch, fall back
to the per-sequence loop: padding would cost more memory than the loop costs time."""


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's cached keys and values, padded to the longest.

    Args:
        k_cache, v_cache: [cache_slots, kv_heads, head_dim]
        req_to_token: [max_requests, max_context] cache slot of each request's tokens
        req_pool_indices: [B] each sequence's row in req_to_token
        seq_lens: [B] tokens cached per sequence (including the ones being computed)
    Returns:
        keys, values: [B, kv_heads, L, head_dim], L = max(seq_lens); padding holds slot 0's entry
        valid: [B, L] bool, False on padding
    """
    length = int(seq_lens.max())
    positions = torch.arange(length, device=seq_lens.device)
    valid = positions[None, :] < seq_lens[:, None]
    slots = req_to_token[req_pool_indices, :length].long().masked_fill(~valid, 0)
    return k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2), valid


def batched_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scaling: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """One new token per sequence attends to all of its cached tokens.

    Args:
        query: [B, heads, head_dim]
        keys, values, valid: from `gather_kv`
    Returns:
        [B, heads, head_dim]
    """
    out = scaled_dot_product_attention(
        query.unsqueeze(2),
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=valid[:, None, None, :],
        scale=scaling,
        enable_gqa=enable_gqa,
    )
    return out.squeeze(2)


def batched_extend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scaling: float | None,
    enable_gqa: bool,
    causal: bool,
) -> torch.Tensor:
    """New tokens of every sequence (after a cached prefix) attend to the prefix and, causally, each other.

    Args:
        query: [T, heads, head_dim], the sequences' new tokens concatenated (T = sum(extend_lens))
        keys, values, valid: from `gather_kv` over prefix + new tokens
        prefix_lens, extend_lens: [B]
    Returns:
        [T, heads, head_dim] in the order of `query`
    """
    width = int(extend_lens.max())
    steps = torch.arange(width, device=query.device)
    query_valid = steps[None, :] < extend_lens[:, None]  # [B, Lq]
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    token = (starts[:, None] + steps[None, :]).masked_fill(~query_valid, 0)  # [B, Lq]
    padded = query[token].transpose(1, 2)  # [B, heads, Lq, D]
    mask = valid[:, None, :].expand(-1, width, -1)  # [B, Lq, L]
    if causal:
        # Query j of a sequence sits at absolute position prefix + j and sees keys up to there. Padded
        # query rows see at least key 0, so no row is fully masked (which would give NaN).
        key_pos = torch.arange(valid.shape[1], device=query.device)
        mask = mask & (key_pos[None, None, :] <= (prefix_lens[:, None] + steps[None, :])[:, :, None])
    out = scaled_dot_product_attention(
        padded,
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=mask[:, None],
        scale=scaling,
        enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2)[query_valid]


class BatchedTorchNativeAttnBackend(TorchNativeAttnBackend):
    """SGLang's torch_native backend with one padded attention call per layer instead of one per sequence."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        # Once per forward pass, in the thread that runs it: where the trainer's thread requests take effect.
        engine_threads.follow()
        super().init_forward_metadata(forward_batch)

    def _run_sdpa_forward_decode(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        if not _batchable(encoder_lens, is_cross_attn, sliding_window_size, query, seq_lens, 1):
            return super()._run_sdpa_forward_decode(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                encoder_lens,
                scaling=scaling,
                enable_gqa=enable_gqa,
                causal=causal,
                is_cross_attn=is_cross_attn,
                sliding_window_size=sliding_window_size,
            )
        keys, values, valid = gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
        output.copy_(batched_decode(query, keys, values, valid, scaling, enable_gqa))
        return output

    def _run_sdpa_forward_extend(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        if not _batchable(
            encoder_lens, is_cross_attn, sliding_window_size, query, seq_lens, int(extend_seq_lens.max())
        ):
            return super()._run_sdpa_forward_extend(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                extend_prefix_lens,
                extend_seq_lens,
                encoder_lens,
                scaling=scaling,
                enable_gqa=enable_gqa,
                causal=causal,
                is_cross_attn=is_cross_attn,
                sliding_window_size=sliding_window_size,
            )
        keys, values, valid = gather_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
        output.copy_(
            batched_extend(
                query, keys, values, valid, extend_prefix_lens, extend_seq_lens, scaling, enable_gqa, causal
            )
        )
        return output


def _batchable(
    encoder_lens: torch.Tensor | None,
    is_cross_attn: bool,
    sliding_window_size: int | None,
    query: torch.Tensor,
    seq_lens: torch.Tensor,
    queries_per_sequence: int,
) -> bool:
    if (
        encoder_lens is not None
        or is_cross_attn
        or (sliding_window_size is not None and sliding_window_size > -1)
    ):
        return False
    if seq_lens.numel() == 0:
        return False
    scores = seq_lens.numel() * query.shape[1] * queries_per_sequence * int(seq_lens.max())
    return scores <= MAX_PADDED_SCORES


def register() -> None:
    """Make SGLang build the batched backend wherever it would build torch_native (idempotent)."""

    @register_attention_backend("torch_native")
    def create_batched_torch_native_backend(runner: Any) -> BatchedTorchNativeAttnBackend:
        return BatchedTorchNativeAttnBackend(runner)
