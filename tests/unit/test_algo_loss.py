"""Policy loss, actor loss (entropy/KL/TIS terms), AlgoConfig and import hygiene of dapo_megatron.algo."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_megatron.algo.config import AlgoConfig
from dapo_megatron.algo.loss import (
    compute_actor_loss,
    compute_policy_loss,
    rollout_mismatch_metrics,
    truncated_is_weights,
)
from tests.conftest import assert_import_is_light

# (advantage, ratio, expected per-token loss, pg_clipfrac, upper_bound, lower_bound, dual fired)
# eps_low 0.2, eps_high 0.28, c 10; computed by hand from the DAPO/verl definition.
SINGLE_TOKEN_CASES = [
    (+1.0, 1.50, -1.28, 1.0, 1.0, 0.0, 0.0),  # upper clip: -1 * 1.28
    (+1.0, 1.25, -1.25, 0.0, 0.0, 0.0, 0.0),  # inside the widened range [0.8, 1.28]
    (+1.0, 0.50, -0.50, 0.0, 0.0, 0.0, 0.0),  # A > 0 below range: L1 = -0.5 > L2 = -0.8, unclipped
    (-1.0, 0.50, +0.80, 1.0, 0.0, 1.0, 0.0),  # lower clip: max(0.5, 0.8)
    (-1.0, 1.50, +1.50, 0.0, 0.0, 0.0, 0.0),  # A < 0 above range: L1 = 1.5 > L2 = 1.28
    (-1.0, 20.0, +10.0, 0.0, 0.0, 0.0, 1.0),  # dual clip: min(20, c = 10)
]


def _single_token(advantage: float, ratio: float, **kwargs: object) -> tuple[torch.Tensor, dict]:
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.full((1, 1), math.log(ratio), dtype=torch.float64)
    return compute_policy_loss(
        new, old, torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1), **kwargs
    )


@pytest.mark.parametrize(
    ("adv", "ratio", "expected", "clipfrac", "upper", "lower", "dual"), SINGLE_TOKEN_CASES
)
def test_single_token_cases(
    adv: float, ratio: float, expected: float, clipfrac: float, upper: float, lower: float, dual: float
) -> None:
    loss, metrics = _single_token(adv, ratio, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert metrics["pg_clipfrac"].item() == clipfrac
    assert metrics["pg_clipfrac_upper_bound"].item() == upper
    assert metrics["pg_clipfrac_lower_bound"].item() == lower
    assert metrics["pg_clipfrac_lower"].item() == dual
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(ratio), abs=1e-9)


def test_six_cases_batched_and_defaults() -> None:
    """The same six tokens in one [1, 6] row with the default hyperparameters (DAPO's)."""
    adv = torch.tensor([[c[0] for c in SINGLE_TOKEN_CASES]], dtype=torch.float64)
    log_ratio = torch.tensor([[math.log(c[1]) for c in SINGLE_TOKEN_CASES]], dtype=torch.float64)
    loss, metrics = compute_policy_loss(log_ratio, torch.zeros_like(log_ratio), adv, torch.ones(1, 6))
    expected = [c[2] for c in SINGLE_TOKEN_CASES]
    assert loss.item() == pytest.approx(sum(expected) / 6, abs=1e-9)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)


def test_dual_clip_disabled_and_validated() -> None:
    loss, metrics = _single_token(-1.0, 20.0, clip_ratio_c=None)
    assert loss.item() == pytest.approx(20.0)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    for bad_c in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
            _single_token(-1.0, 20.0, clip_ratio_c=bad_c)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        _single_token(1.0, 1.0, clip_ratio_low=1.0)


def test_gradients_of_single_tokens() -> None:
    """d loss / d log_prob = -A·ratio on the unclipped branch, 0 on every clipped branch."""
    cases = [(+1.0, 1.25, -1.25), (+1.0, 1.5, 0.0), (-1.0, 0.5, 0.0), (-1.0, 1.5, 1.5), (-1.0, 20.0, 0.0)]
    for adv, ratio, expected_grad in cases:
        log_prob = torch.full((1, 1), math.log(ratio), dtype=torch.float64, requires_grad=True)
        loss, _ = compute_policy_loss(
            log_prob, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv]), torch.ones(1, 1)
        )
        loss.backward()
        assert log_prob.grad.item() == pytest.approx(expected_grad), (adv, ratio)


def test_advantage_shapes_broadcast() -> None:
    torch.manual_seed(0)
    log_prob, old = torch.randn(3, 5), torch.randn(3, 5)
    adv = torch.randn(3)
    mask = torch.ones(3, 5)
    loss_row, _ = compute_policy_loss(log_prob, old, adv, mask)
    loss_tok, _ = compute_policy_loss(log_prob, old, adv[:, None].expand(3, 5), mask)
    torch.testing.assert_close(loss_row, loss_tok)


def test_num_tokens_forms_and_default() -> None:
    torch.manual_seed(1)
    log_prob, old, adv = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    default, _ = compute_policy_loss(log_prob, old, adv, mask)
    for n in (4, 4.0, torch.tensor(4.0)):
        loss, _ = compute_policy_loss(log_prob, old, adv, mask, num_tokens=n)
        torch.testing.assert_close(loss, default)
    halved, _ = compute_policy_loss(log_prob, old, adv, mask, num_tokens=8)
    torch.testing.assert_close(halved, default / 2)


def test_global_token_mean_over_micro_batches() -> None:
    """Σ micro-batch losses with the global token count == whole-batch loss, gradients included."""
    torch.manual_seed(2)
    log_prob = torch.randn(4, 6, dtype=torch.float64) * 0.3
    old = log_prob.detach() + torch.randn(4, 6, dtype=torch.float64) * 0.3
    adv = torch.randn(4, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 1, 3])  # uneven micro-batches: rows {0, 1} hold 7 tokens, rows {2, 3} 4
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()

    whole_input = log_prob.clone().requires_grad_()
    whole, _ = compute_policy_loss(whole_input, old, adv, mask)
    whole.backward()

    micro_input = log_prob.clone().requires_grad_()
    global_tokens = mask.sum()
    total = torch.zeros((), dtype=torch.float64)
    naive = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 4)):
        part, _ = compute_policy_loss(
            micro_input[rows], old[rows], adv[rows], mask[rows], num_tokens=global_tokens
        )
        local, _ = compute_policy_loss(log_prob[rows], old[rows], adv[rows], mask[rows])
        total = total + part
        naive = naive + local.detach() / 2
    total.backward()
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(micro_input.grad, whole_input.grad)
    assert abs(naive.item() - whole.item()) > 1e-3  # mean of micro-batch means is a different estimator


def test_log_ratio_clamp_keeps_loss_and_grad_finite() -> None:
    """exp(100) = inf: 0·inf = NaN for a zero advantage and inf·0 in backward. The clamp prevents both."""
    adv = torch.tensor([0.0, -1.0, 1.0], dtype=torch.float32)
    old = torch.zeros(3, 1)
    mask = torch.ones(3, 1)
    log_prob = torch.full((3, 1), 100.0, requires_grad=True)
    loss, _ = compute_policy_loss(log_prob, old, adv, mask)
    loss.backward()
    # tokens: A=0 -> 0; A=-1 -> dual clip 10; A=+1 -> upper clip -1.28
    assert loss.item() == pytest.approx((0.0 + 10.0 - 1.28) / 3)
    assert torch.equal(log_prob.grad, torch.zeros(3, 1))

    # Without the clamp: the zero-advantage token makes the loss NaN ...
    unclamped, _ = compute_policy_loss(log_prob.detach(), old, adv, mask, log_ratio_clamp=None)
    assert torch.isnan(unclamped)
    # ... and even with finite losses (A = ±1 only) the gradient is NaN.
    unclamped_input = torch.full((2, 1), 100.0, requires_grad=True)
    finite_loss, _ = compute_policy_loss(unclamped_input, old[:2], adv[1:], mask[:2], log_ratio_clamp=None)
    finite_loss.backward()
    assert torch.isfinite(finite_loss) and torch.isnan(unclamped_input.grad).all()


def test_ppo_kl_uses_the_clamped_log_ratio() -> None:
    """verl's ppo_kl is the masked mean of -clamp(log π_θ - log π_old, -20, 20), like the ratio it trains
    on."""
    log_prob = torch.tensor([[30.0, -50.0, 0.5, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    _, metrics = compute_policy_loss(log_prob, torch.zeros_like(log_prob), torch.ones(1), mask)
    assert metrics["ppo_kl"].item() == pytest.approx((-20.0 + 20.0 - 0.5) / 3)
    _, unclamped = compute_policy_loss(
        log_prob, torch.zeros_like(log_prob), torch.ones(1), mask, log_ratio_clamp=None
    )
    assert unclamped["ppo_kl"].item() == pytest.approx((-30.0 + 50.0 - 0.5) / 3)


def test_log_ratio_clamp_is_negligible_for_moderate_ratios() -> None:
    torch.manual_seed(3)
    log_prob, old, adv = torch.randn(4, 8) * 5, torch.randn(4, 8) * 5, torch.randn(4, 8)
    mask = torch.ones(4, 8)
    clamped, _ = compute_policy_loss(log_prob, old, adv, mask)
    unclamped, _ = compute_policy_loss(log_prob, old, adv, mask, log_ratio_clamp=None)
    torch.testing.assert_close(clamped, unclamped)


@pytest.mark.parametrize("name", ["log_prob", "old_log_prob", "advantages"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inputs_raise_naming_the_tensor(name: str, bad: float) -> None:
    inputs = {
        "log_prob": torch.zeros(2, 3),
        "old_log_prob": torch.zeros(2, 3),
        "advantages": torch.ones(2),
    }
    inputs[name].view(-1)[1] = bad
    with pytest.raises(ValueError, match=rf"^{name} contains non-finite"):
        compute_policy_loss(
            inputs["log_prob"], inputs["old_log_prob"], inputs["advantages"], torch.ones(2, 3)
        )


def test_rollout_is_weights_scale_tokens_without_gradient() -> None:
    log_prob = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = compute_policy_loss(
        log_prob, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), rollout_is_weights=weights
    )
    loss.backward()
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)  # ratio 1, A = 1: per-token -1·w
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.25, -1.0]]))
    assert weights.grad is None


def test_clip_fraction_split_adds_up() -> None:
    torch.manual_seed(4)
    log_prob, old, adv = torch.randn(6, 9), torch.randn(6, 9), torch.randn(6, 9)
    mask = torch.rand(6, 9) > 0.3
    _, metrics = compute_policy_loss(log_prob, old, adv, mask)
    torch.testing.assert_close(
        metrics["pg_clipfrac"], metrics["pg_clipfrac_upper_bound"] + metrics["pg_clipfrac_lower_bound"]
    )
    valid = mask.float()
    torch.testing.assert_close(metrics["ppo_kl"], ((old - log_prob) * valid).sum() / valid.sum())
    assert all(not v.requires_grad for v in metrics.values())


def test_seq_mean_mode_passes_through() -> None:
    """With loss_agg_mode=seq-mean-token-mean each row counts equally whatever its length."""
    log_prob = torch.zeros(2, 4)
    adv = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    token_mean, _ = compute_policy_loss(log_prob, log_prob, adv, mask)
    seq_mean, _ = compute_policy_loss(log_prob, log_prob, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert token_mean.item() == pytest.approx(-(4 * 1.0 + 2.0) / 5)
    assert seq_mean.item() == pytest.approx(-(1.0 + 2.0) / 2)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 7),
    extra_pad=st.integers(0, 5),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
)
def test_masking_and_padding_properties(
    batch: int, length: int, extra_pad: int, seed: int, mode: str
) -> None:
    """Masked tokens get zero gradient and do not change the loss; padding length does not matter."""
    gen = torch.Generator().manual_seed(seed)
    log_prob = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    old = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) > 0.4

    inputs = log_prob.clone().requires_grad_()
    loss, _ = compute_policy_loss(inputs, old, adv, mask, loss_agg_mode=mode)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(inputs.grad[~mask] == 0)

    # Garbage (finite) values at masked positions change nothing.
    noise = torch.randn(batch, length, generator=gen, dtype=torch.float64) * 10
    scrambled, _ = compute_policy_loss(
        torch.where(mask, log_prob, noise), torch.where(mask, old, -noise), adv, mask, loss_agg_mode=mode
    )
    torch.testing.assert_close(scrambled, loss.detach())

    # Right-padding every row with extra masked columns changes nothing.
    def pad(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, extra_pad), value=value)

    padded, _ = compute_policy_loss(
        pad(log_prob, 3.0), pad(old, -2.0), adv, pad(mask, False), loss_agg_mode=mode
    )
    torch.testing.assert_close(padded, loss.detach())


# ---------------------------------------------------------------- entropy, TIS, actor loss


def test_truncated_is_weights_and_mismatch_metrics() -> None:
    old = torch.tensor([[0.0, 0.0, -1.0]])
    rollout = torch.tensor([[0.0, -math.log(4.0), 0.0]])  # old - rollout = 0, ln 4, -1
    weights = truncated_is_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, math.exp(-1.0)]]))
    mask = torch.tensor([[1, 1, 0]])
    metrics = rollout_mismatch_metrics(old, rollout, mask)
    # r = rollout - train over the two valid tokens: 0 and -ln 4
    assert metrics["rollout_logprob_abs_diff"].item() == pytest.approx(math.log(4.0) / 2)
    assert metrics["rollout_kl_k3"].item() == pytest.approx((0.25 + math.log(4.0) - 1.0) / 2)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, rollout, cap=0.0)


def _actor_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "log_prob": (torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.2).requires_grad_(),
        "old_log_prob": torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.2,
        "advantages": torch.randn(3, generator=gen, dtype=torch.float64),
        "response_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]),
    }


def test_actor_loss_defaults_equal_policy_loss() -> None:
    inputs = _actor_inputs(5)
    entropy = torch.rand(3, 5, dtype=torch.float64)
    loss, metrics = compute_actor_loss(**inputs, config=AlgoConfig(), entropy=entropy)
    pg_loss, _ = compute_policy_loss(**inputs)
    torch.testing.assert_close(loss, pg_loss)
    mask = inputs["response_mask"].double()
    torch.testing.assert_close(metrics["entropy"], (entropy * mask).sum() / mask.sum())


def test_actor_loss_entropy_bonus_and_its_gradient() -> None:
    inputs = _actor_inputs(6)
    entropy = torch.rand(3, 5, dtype=torch.float64, requires_grad=True)
    config = AlgoConfig(entropy_coeff=0.01)
    loss, _ = compute_actor_loss(**inputs, config=config, entropy=entropy)
    pg_loss, _ = compute_policy_loss(**inputs)
    mask = inputs["response_mask"].double()
    torch.testing.assert_close(loss, pg_loss - 0.01 * (entropy * mask).sum() / mask.sum())
    loss.backward()
    torch.testing.assert_close(entropy.grad, -0.01 * mask / mask.sum())
    with pytest.raises(ValueError, match="entropy_coeff"):
        compute_actor_loss(**_actor_inputs(6), config=config)


def test_actor_loss_rejects_non_finite_extra_inputs() -> None:
    inputs = _actor_inputs(9)
    bad = inputs["old_log_prob"].clone()
    bad[1, 2] = math.nan
    with pytest.raises(ValueError, match=r"^rollout_log_prob contains non-finite"):
        compute_actor_loss(**inputs, config=AlgoConfig(), rollout_log_prob=bad)


def test_actor_loss_applies_tis_only_when_enabled() -> None:
    inputs = _actor_inputs(8)
    rollout = inputs["old_log_prob"] - 0.3  # weights exp(0.3) = 1.35, capped at 1.2
    off_loss, off_metrics = compute_actor_loss(**inputs, config=AlgoConfig(), rollout_log_prob=rollout)
    on_loss, on_metrics = compute_actor_loss(
        **inputs, config=AlgoConfig(tis_cap=1.2), rollout_log_prob=rollout
    )
    pg_loss, _ = compute_policy_loss(**inputs)
    torch.testing.assert_close(off_loss, pg_loss)
    torch.testing.assert_close(on_loss, 1.2 * pg_loss)
    for metrics in (off_metrics, on_metrics):
        assert metrics["rollout_logprob_abs_diff"].item() == pytest.approx(0.3)
    assert "tis_weight_mean" not in off_metrics
    assert on_metrics["tis_weight_mean"].item() == pytest.approx(1.2)


def _loss_and_grad(inputs: dict[str, torch.Tensor], **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    log_prob = inputs["log_prob"].detach().clone().requires_grad_()
    loss, _ = compute_actor_loss(**{**inputs, "log_prob": log_prob}, **kwargs)  # type: ignore[arg-type]
    loss.backward()
    return loss.detach(), log_prob.grad


def test_zero_lag_is_exactly_the_on_policy_loss_and_gradient() -> None:
    """Engine log-probs far from the trainer's (weights e^1 and e^-1, both sides of the cap) change nothing
    while no row lags: loss and gradient are bitwise those of compute_policy_loss."""
    inputs = _actor_inputs(11)
    rollout = inputs["old_log_prob"] + torch.tensor([[1.0], [-1.0], [0.5]], dtype=torch.float64)
    expected_loss, _ = compute_policy_loss(**inputs)
    expected_loss.backward()
    loss, grad = _loss_and_grad(
        inputs, config=AlgoConfig(), rollout_log_prob=rollout, lag=torch.zeros(3, dtype=torch.long)
    )
    assert torch.equal(loss, expected_loss.detach())
    assert torch.equal(grad, inputs["log_prob"].grad)


def test_lagged_rows_get_the_decoupled_ppo_weight() -> None:
    """Row 0 is on policy, row 1 lags one update, row 2 two. By hand, per token: the clipped surrogate around
    π_prox = old_log_prob, times min(π_prox / π_behav, 2) on the lagged rows: row 1's engine log-probs are
    0.3 below π_prox (weight e^0.3), row 2's 1.0 below (e^1 truncated to 2). Token mean over 10 tokens."""
    inputs = _actor_inputs(12)
    rollout = inputs["old_log_prob"] - torch.tensor([[5.0], [0.3], [1.0]], dtype=torch.float64)
    lag = torch.tensor([0, 1, 2])
    loss, grad = _loss_and_grad(inputs, config=AlgoConfig(lag_is_cap=2.0), rollout_log_prob=rollout, lag=lag)

    ratio = torch.exp(inputs["log_prob"] - inputs["old_log_prob"])
    adv = inputs["advantages"].unsqueeze(-1)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * 10.0), surrogate)
    weight = torch.tensor([[1.0], [math.exp(0.3)], [2.0]], dtype=torch.float64)
    mask = inputs["response_mask"].double()
    expected = (surrogate * weight * mask).sum() / 10.0
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, inputs["log_prob"].grad, rtol=1e-12, atol=0)

    _, metrics = compute_actor_loss(
        **_actor_inputs(12), config=AlgoConfig(lag_is_cap=2.0), rollout_log_prob=rollout, lag=lag
    )
    # Lagged valid tokens: 2 of row 1 (e^0.3), 3 of row 2 (truncated to 2).
    assert metrics["lagged_tokens"].item() == 5
    assert metrics["lag_is_weight_mean"].item() == pytest.approx((2 * math.exp(0.3) + 3 * 2.0) / 5)
    assert metrics["lag_is_weight_max"].item() == pytest.approx(2.0)
    assert metrics["lag_is_truncated_frac"].item() == pytest.approx(3 / 5)

    # Off: the lagged rows train as on-policy ones.
    off, _ = _loss_and_grad(
        _actor_inputs(12), config=AlgoConfig(lag_is_cap=None), rollout_log_prob=rollout, lag=lag
    )
    torch.testing.assert_close(off, compute_policy_loss(**_actor_inputs(12))[0].detach())


def test_lag_weights_replace_tis_on_lagged_rows_only() -> None:
    """With TIS on as well, on-policy rows keep the TIS weight (cap 1.1: e^0.3 -> 1.1) and lagged rows take
    the lag weight (cap 2: e^0.3 stays)."""
    inputs = _actor_inputs(13)
    rollout = inputs["old_log_prob"] - 0.3
    config = AlgoConfig(tis_cap=1.1, lag_is_cap=2.0)
    both, _ = compute_actor_loss(
        **inputs, config=config, rollout_log_prob=rollout, lag=torch.tensor([0, 1, 0])
    )
    weights = torch.tensor([[1.1], [math.exp(0.3)], [1.1]], dtype=torch.float64).expand(3, 5)
    expected, _ = compute_policy_loss(**inputs, rollout_is_weights=weights)
    torch.testing.assert_close(both, expected, rtol=1e-12, atol=0)


# ---------------------------------------------------------------- AlgoConfig


def test_config_defaults_are_dapo() -> None:
    config = AlgoConfig()
    assert (config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert config.loss_agg_mode == "token-mean"
    assert (config.overlong_buffer_enable, config.overlong_buffer_length, config.overlong_penalty_factor) == (
        True,
        4096,
        1.0,
    )
    assert not config.overlong_filter
    assert (config.entropy_coeff, config.tis_cap) == (0.0, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"clip_ratio_c": 0.5},
            r"algo\.clip_ratio_c must be > 1 \(dual-clip bound\); got 0\.5\. Set algo\.clip_ratio_c=null",
        ),
        ({"clip_ratio_low": 1.0}, r"algo\.clip_ratio_low must be in \[0, 1\)"),
        ({"clip_ratio_high": -0.1}, r"algo\.clip_ratio_high"),
        ({"clip_ratio_high": math.nan}, r"algo\.clip_ratio_high"),
        (
            {"loss_agg_mode": "seq-mean"},
            r"algo\.loss_agg_mode must be one of token-mean, seq-mean-token-mean, seq-mean-token-sum",
        ),
        ({"adv_eps": -1e-6}, r"algo\.adv_eps"),
        ({"overlong_buffer_length": 0}, r"algo\.overlong_buffer_length"),
        ({"overlong_penalty_factor": -1.0}, r"algo\.overlong_penalty_factor"),
        ({"entropy_coeff": math.inf}, r"algo\.entropy_coeff"),
        ({"tis_cap": 0.0}, r"algo\.tis_cap"),
        ({"lag_is_cap": -1.0}, r"algo\.lag_is_cap must be > 0; got -1\.0\. Set algo\.lag_is_cap=null"),
        ({"log_ratio_clamp": 0.0}, r"algo\.log_ratio_clamp"),
        ({"logprob_chunk_size": 0}, r"algo\.logprob_chunk_size"),
    ],
)
def test_config_validation_names_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**overrides)


def test_config_fields_are_structured_config_scalars() -> None:
    allowed = {"str", "int", "float", "bool", "float | None", "int | None", "str | None"}
    for field in dataclasses.fields(AlgoConfig):
        assert str(field.type).replace("<class '", "").replace("'>", "") in allowed, field


def test_config_works_as_omegaconf_structured_config() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    schema = omegaconf.OmegaConf.structured(AlgoConfig)
    merged = omegaconf.OmegaConf.merge(schema, {"clip_ratio_c": None, "tis_cap": 2.0})
    config = omegaconf.OmegaConf.to_object(merged)
    assert isinstance(config, AlgoConfig)
    assert config.clip_ratio_c is None and config.tis_cap == 2.0
    with pytest.raises(ValueError, match=r"algo\.clip_ratio_c must be > 1"):
        omegaconf.OmegaConf.to_object(omegaconf.OmegaConf.merge(schema, {"clip_ratio_c": 0.5}))


# ---------------------------------------------------------------- import hygiene


def test_importing_algo_does_not_pull_heavy_frameworks() -> None:
    assert_import_is_light("dapo_megatron.algo", ("megatron", "transformers", "sglang", "omegaconf", "hydra"))
