"""Chunked log-prob/entropy kernel vs the dense autograd computation (single process, TP1)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.algo.logprobs import vocab_parallel_logprobs


def dense_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full-vocab log_softmax of logits / T with padded columns at -inf."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if vocab_size is not None:
        z = z.masked_fill(torch.arange(z.shape[-1]) >= vocab_size, -torch.inf)
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)  # 0·(−inf) := 0 for padded columns
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _compare(
    tokens: int,
    vocab: int,
    *,
    temperature: float,
    vocab_size: int | None,
    chunk_size: int,
    seed: int,
    use_log_prob: bool = True,
    use_entropy: bool = True,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=gen, dtype=torch.float64) * 4
    labels = torch.randint(0, vocab_size or vocab, (tokens,), generator=gen)
    w_lp = torch.randn(tokens, generator=gen, dtype=torch.float64) * use_log_prob
    w_h = torch.randn(tokens, generator=gen, dtype=torch.float64) * use_entropy

    ours_in = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(
        ours_in, labels, temperature=temperature, vocab_size=vocab_size, chunk_size=chunk_size
    )
    ref_in = logits.clone().requires_grad_()
    ref_lp, ref_ent = dense_logprobs(ref_in, labels, temperature, vocab_size)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)

    # Only the outputs that reach the loss get a gradient (the others arrive as None in backward).
    terms = ([(lp * w_lp).sum()] if use_log_prob else []) + ([(ent * w_h).sum()] if use_entropy else [])
    torch.stack(terms).sum().backward()
    ref_terms = ([(ref_lp * w_lp).sum()] if use_log_prob else []) + (
        [(ref_ent * w_h).sum()] if use_entropy else []
    )
    torch.stack(ref_terms).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad)
    if vocab_size is not None:
        assert torch.all(ours_in.grad[:, vocab_size:] == 0)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("vocab_size", [None, 45])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_matches_dense_values_and_grads(temperature: float, vocab_size: int | None, chunk_size: int) -> None:
    _compare(13, 48, temperature=temperature, vocab_size=vocab_size, chunk_size=chunk_size, seed=chunk_size)


@pytest.mark.parametrize(("use_log_prob", "use_entropy"), [(True, False), (False, True)])
def test_grad_through_one_output_only(use_log_prob: bool, use_entropy: bool) -> None:
    _compare(
        9,
        32,
        temperature=0.8,
        vocab_size=30,
        chunk_size=4,
        seed=1,
        use_log_prob=use_log_prob,
        use_entropy=use_entropy,
    )


@settings(max_examples=20, deadline=None)
@given(
    tokens=st.integers(0, 12),
    vocab=st.integers(1, 40),
    pad=st.integers(0, 8),
    chunk_size=st.integers(1, 16),
    temperature=st.floats(0.3, 3.0),
    seed=st.integers(0, 2**16),
)
def test_property_matches_dense(
    tokens: int, vocab: int, pad: int, chunk_size: int, temperature: float, seed: int
) -> None:
    _compare(tokens, vocab + pad, temperature=temperature, vocab_size=vocab, chunk_size=chunk_size, seed=seed)


def test_gradcheck() -> None:
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 5, 2])

    def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = vocab_parallel_logprobs(x, labels, temperature=0.9, vocab_size=6, chunk_size=3)
        return lp, ent

    assert torch.autograd.gradcheck(both, (logits,))


def test_without_entropy() -> None:
    logits = torch.randn(6, 20, requires_grad=True)
    labels = torch.randint(0, 20, (6,))
    lp, ent = vocab_parallel_logprobs(logits, labels, compute_entropy=False, chunk_size=4)
    assert ent is None
    lp.sum().backward()
    ref_in = logits.detach().clone().requires_grad_()
    ref_lp, _ = dense_logprobs(ref_in, labels)
    ref_lp.sum().backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(logits.grad, ref_in.grad)


def test_bf16_logits_compute_in_fp32() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(8, 300) * 5).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (8,))
    lp, ent = vocab_parallel_logprobs(logits, labels, temperature=0.7, chunk_size=3)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_in = logits.detach().float().requires_grad_()
    ref_lp, ref_ent = dense_logprobs(ref_in, labels, 0.7)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)  # same bf16 inputs, fp32 maths
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    (lp.sum() + ent.sum()).backward()
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), ref_in.grad, atol=1e-2, rtol=1e-2)


def test_leading_dims() -> None:
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 3))
    lp, ent = vocab_parallel_logprobs(logits, labels, chunk_size=2)
    ref_lp, ref_ent = dense_logprobs(logits.reshape(6, 11), labels.reshape(6))
    assert lp.shape == (2, 3) and ent.shape == (2, 3)
    torch.testing.assert_close(lp.reshape(6), ref_lp)
    torch.testing.assert_close(ent.reshape(6), ref_ent)


def test_saves_only_the_input_and_per_token_statistics() -> None:
    """Backward recomputes the softmax: nothing of size [tokens, vocab] is saved except the input."""
    tokens, vocab = 32, 500
    logits = torch.randn(tokens, vocab, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = vocab_parallel_logprobs(logits, labels, chunk_size=8)
    assert all(out.requires_grad for out in outputs)
    large = [t for t in saved if t.numel() > tokens]
    assert len(large) == 1 and large[0].data_ptr() == logits.data_ptr()
    # the dense computation saves several full-vocab tensors
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dense_logprobs(logits, labels)
    assert sum(t.numel() > tokens for t in saved) >= 3


def test_validation() -> None:
    logits, labels = torch.randn(2, 8), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_logprobs(logits, labels, vocab_size=9)
    with pytest.raises(ValueError, match="labels shape"):
        vocab_parallel_logprobs(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs(logits, labels, chunk_size=0)
