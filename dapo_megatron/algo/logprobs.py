"""Per-token log-prob of the sampled token and policy entropy from (vocab-parallel) logits.

The logits of a large-vocab model (Qwen2.5: 152064 columns) are by far the largest activation of an
RL step. The dense computation ``log_softmax(logits.float() / T)`` plus an entropy keeps several
full-vocab float32 copies alive for backward. Here the work is done per chunk of tokens, in float32
only inside the chunk, and a custom ``autograd.Function`` saves just the input logits and a few
``[tokens]`` statistics; backward recomputes the chunk's softmax. Under tensor parallelism each rank
holds the contiguous vocab slice ``[rank·Vs, (rank+1)·Vs)`` and the full vocab is never gathered:
the forward does two all-reduces in total (a MAX of the row maxima and one SUM of three ``[tokens]``
statistics), and the backward needs none.

Numerics (``z = logits / T``, ``m`` = global row max, ``S = Σ_v exp(z_v − m)``)::

    log_prob = z_label − m − log S
    entropy  = log S − Σ_v exp(z_v − m)·(z_v − m) / S
    ∂log_prob/∂logits_v = (δ_{v,label} − p_v) / T
    ∂entropy/∂logits_v  = −p_v·(log p_v + entropy) / T
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable


def vocab_parallel_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    chunk_size: int = 1024,
    compute_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``labels`` and entropy under ``softmax(logits / temperature)``.

    Same definition as the rollout engine (SGLang): ``log_softmax(logits / T)[label]``.

    Args:
        logits: ``[*, Vs]`` this rank's vocab shard (any float dtype, e.g. bf16). Without a process
            group it is the whole (possibly padded) vocab.
        labels: ``[*]`` integer ids in the GLOBAL vocab, ``0 <= label < vocab_size`` (not checked:
            that would need a host sync).
        temperature: ``T > 0``.
        vocab_size: true vocab size; columns with global index ``>= vocab_size`` (Megatron's padding
            to a multiple of 128·TP) are left out of the softmax, as if their logit were −inf, and
            get zero gradient. ``None``: every column is real.
        process_group: tensor-parallel group the vocab is sharded over (equal contiguous shards in
            rank order); ``None`` means no sharding and no communication.
        chunk_size: tokens processed per chunk; peak extra memory is about two float32
            ``[chunk_size, Vs]`` buffers (plus the gradient of ``logits`` in backward).
        compute_entropy: also return the entropy (one more multiply-add pass over each chunk).

    Returns:
        ``(log_prob, entropy)``: float32 ``[*]`` tensors (float64 for float64 logits), differentiable
        w.r.t. ``logits``; ``entropy`` is ``None`` when ``compute_entropy`` is False. Double backward
        is not supported.
    """
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0; got {chunk_size}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without vocab "
            f"{tuple(logits.shape[:-1])}"
        )
    if process_group is None:
        rank, world_size = 0, 1
    else:
        rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
    shard_width = logits.shape[-1]
    vocab_start = rank * shard_width
    total_columns = world_size * shard_width
    true_vocab = total_columns if vocab_size is None else vocab_size
    if not 0 < true_vocab <= total_columns:
        raise ValueError(
            f"vocab_size must be in (0, {total_columns}] (shard width x TP size); got {vocab_size}"
        )
    # Columns of this shard that are real tokens: [0, valid_columns); the rest is padding.
    valid_columns = min(max(true_vocab - vocab_start, 0), shard_width)

    flat_logits = logits.reshape(-1, shard_width)
    log_prob, entropy = _VocabParallelLogProbs.apply(
        flat_logits,
        labels.reshape(-1),
        temperature,
        vocab_start,
        valid_columns,
        process_group,
        chunk_size,
        compute_entropy,
    )
    log_prob = log_prob.view(labels.shape)
    return log_prob, entropy.view(labels.shape) if compute_entropy else None


def reference_logprobs(logits: Tensor, labels: Tensor, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The definition `vocab_parallel_logprobs` computes, written the naive way a plain PyTorch trainer does:
    a full-vocab float32 ``log_softmax(logits / T)``, the label's entry and ``-Σ p·log p``; autograd keeps
    the full-vocab float32 tensors for backward. ``logits`` ``[*, V]`` (every column real), ``labels``
    ``[*]`` -> float32 ``(log_prob, entropy)`` ``[*]``. The baseline of the kernel's memory and time checks
    (`tools/gpu_check.py`, `bench/bench_logprobs.py`)."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _chunks(num_tokens: int, chunk_size: int) -> range:
    """Start offsets of the token chunks."""
    return range(0, num_tokens, chunk_size)


def _local_label_index(labels: Tensor, vocab_start: int, valid_columns: int) -> tuple[Tensor, Tensor]:
    """For ``labels`` ``[n]`` (global ids): owned-by-this-shard flags and clamped local indices."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < valid_columns)
    return owned, local.clamp(0, max(valid_columns - 1, 0)).unsqueeze(-1)


class _VocabParallelLogProbs(torch.autograd.Function):
    """Chunked, vocab-sharded ``(log_prob, entropy)`` that recomputes the softmax in backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: Tensor,
        labels: Tensor,
        temperature: float,
        vocab_start: int,
        valid_columns: int,
        process_group: dist.ProcessGroup | None,
        chunk_size: int,
        compute_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        num_tokens = logits.shape[0]
        inv_t = 1.0 / temperature
        # float32 maths for bf16/fp16/fp32 logits (float64 stays float64).
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        real_logits = logits[:, :valid_columns]
        owned, local_label = _local_label_index(labels, vocab_start, valid_columns)

        # Global row max in raw-logit units: max(x)/T = max(x/T) for T > 0, so it is taken on the
        # input dtype (no float32 copy). A shard that is all padding contributes -inf.
        if valid_columns > 0:
            row_max = real_logits.amax(dim=-1).to(compute_dtype)
        else:
            row_max = torch.full((num_tokens,), -torch.inf, dtype=compute_dtype, device=logits.device)
        if process_group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=process_group)

        # Per-token partial sums over this shard: [Σ exp(z−m), Σ exp(z−m)·(z−m), (z−m)_label].
        # A shard that is all padding keeps zeros but still joins the all-reduce below.
        partials = torch.zeros(3, num_tokens, dtype=compute_dtype, device=logits.device)
        for start in _chunks(num_tokens, chunk_size) if valid_columns > 0 else ():
            stop = min(start + chunk_size, num_tokens)
            # (x − m) / T: subtracting the float32 row max upcasts bf16 logits in the same pass.
            shifted = torch.sub(real_logits[start:stop], row_max[start:stop, None])
            if temperature != 1.0:
                shifted.mul_(inv_t)
            exp_shifted = torch.exp(shifted)
            partials[0, start:stop] = exp_shifted.sum(dim=-1)
            if compute_entropy:
                partials[1, start:stop] = torch.linalg.vecdot(exp_shifted, shifted)
            picked = shifted.gather(-1, local_label[start:stop]).squeeze(-1)
            partials[2, start:stop] = torch.where(owned[start:stop], picked, 0.0)
            del shifted, exp_shifted  # free before the next chunk allocates
        if process_group is not None:
            dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=process_group)

        sum_exp, weighted, label_shifted = partials
        log_sum_exp = torch.log(sum_exp)
        log_prob = label_shifted - log_sum_exp
        entropy = log_sum_exp - weighted / sum_exp if compute_entropy else log_sum_exp.new_empty(0)

        # Backward needs log p_v = (x_v − m)/T − log S = (x_v − shift)/T with shift = m + T·log S.
        ctx.save_for_backward(logits, labels, row_max + temperature * log_sum_exp, entropy)
        ctx.params = (temperature, vocab_start, valid_columns, chunk_size, compute_entropy)
        # An output that does not reach the loss then arrives as None instead of zeros, which
        # skips its term (and for the entropy two passes per chunk) in backward.
        ctx.set_materialize_grads(False)
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_log_prob: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, labels, shift, entropy = ctx.saved_tensors
        temperature, vocab_start, valid_columns, chunk_size, compute_entropy = ctx.params
        inv_t = 1.0 / temperature
        num_tokens = logits.shape[0]
        grad_logits = torch.zeros_like(logits)  # padded columns keep a zero gradient
        if not compute_entropy:
            grad_entropy = None
        if valid_columns == 0 or (grad_log_prob is None and grad_entropy is None):
            return grad_logits, None, None, None, None, None, None, None

        owned, local_label = _local_label_index(labels, vocab_start, valid_columns)
        real_logits = logits[:, :valid_columns]
        # Per-token scalars folded so each chunk needs few passes:
        #   grad_v = −p_v·(g_H·log p_v + g_lp + g_H·H)/T + [v = label]·g_lp/T
        g_lp = grad_log_prob if grad_log_prob is not None else torch.zeros_like(shift)
        if grad_entropy is not None:
            slope = -grad_entropy * inv_t
            offset = -(g_lp + grad_entropy * entropy) * inv_t
        else:
            offset = -g_lp * inv_t
        label_grad = torch.where(owned, g_lp * inv_t, 0.0).unsqueeze(-1)

        for start in _chunks(num_tokens, chunk_size):
            stop = min(start + chunk_size, num_tokens)
            log_p = torch.sub(real_logits[start:stop], shift[start:stop, None])
            if temperature != 1.0:
                log_p.mul_(inv_t)
            prob = torch.exp(log_p)
            if grad_entropy is not None:
                grad_chunk = log_p.mul_(slope[start:stop, None]).add_(offset[start:stop, None]).mul_(prob)
            else:
                grad_chunk = prob.mul_(offset[start:stop, None])
            grad_chunk.scatter_add_(-1, local_label[start:stop], label_grad[start:stop])
            grad_logits[start:stop, :valid_columns] = grad_chunk
            del log_p, prob, grad_chunk
        return grad_logits, None, None, None, None, None, None, None
