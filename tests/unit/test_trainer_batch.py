"""A rollout batch split over data-parallel ranks, optimizer steps and micro-batches (trainer/batch.py,
PolicyRows.micro_batches): the fixed split of old, the token-budget plan, and what neither may change."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dapo_megatron import config as C
from dapo_megatron.algo.config import AlgoConfig
from dapo_megatron.models.sequence_padding import padded_length
from dapo_megatron.records import PolicyRows, ScoredGroup, ScoredSample
from dapo_megatron.trainer.actor import dapo_loss_fn, micro_batch_sizes
from dapo_megatron.trainer.batch import build_rows, policy_lag, sample_lags, split_rows
from dapo_megatron.trainer.config import TrainerConfig


def numbered_rows(widths: list[int]) -> PolicyRows:
    """Rows of the given widths (label positions; a 2-token prompt, then the response); the advantage of
    row i is i, so a row can be recognised after it has been moved. tokens: [n, max + 1]."""
    n, length = len(widths), max(widths)
    mask = torch.zeros(n, length)
    for row, width in enumerate(widths):
        mask[row, 1:width] = 1.0
    tokens = torch.arange(n * (length + 1)).reshape(n, length + 1) % 97
    return PolicyRows(
        tokens=tokens,
        response_mask=mask,
        advantages=torch.arange(n, dtype=torch.float32),
        old_log_prob=torch.randn(n, length),
    )


def ids(rows: PolicyRows) -> list[int]:
    return [int(a) for a in rows.advantages]


def trainer(steps: int, micro_batch_size: int = 2, budget: int | None = None) -> TrainerConfig:
    return TrainerConfig(
        train_batch_size=steps,
        ppo_mini_batch_size=1,
        micro_batch_size=micro_batch_size,
        max_tokens_per_micro_batch=budget,
    )


def test_fixed_micro_batches_keep_the_contiguous_split() -> None:
    rows = numbered_rows([3] * 10)
    share = split_rows(rows, 2, 1, trainer(steps=2))
    assert ids(share.rows) == [5, 6, 7, 8, 9]
    assert share.micro_batch_sizes == [[2], [2, 1]]  # steps of 2 and 3 rows, micro-batches of 2
    assert [ids(mini) for mini, _ in share.mini_batches()] == [[5, 6], [7, 8, 9]]


WIDTHS = [int(w) for w in torch.randint(2, 40, (37,), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize(("ranks", "steps"), [(1, 3), (3, 4), (4, 2)])
def test_optimizer_steps_train_on_the_same_rows_with_a_token_budget(ranks: int, steps: int) -> None:
    rows = numbered_rows(WIDTHS)
    per_step: dict[str, list[set[int]]] = {}
    configs = {
        "fixed": (trainer(steps), 1),
        "budget": (trainer(steps, budget=60), 1),
        "padded budget": (trainer(steps, budget=60), 16),
    }
    for name, (config, multiple) in configs.items():
        shares = [split_rows(rows, ranks, rank, config, multiple=multiple) for rank in range(ranks)]
        per_step[name] = [
            set().union(*(ids(share.mini_batches()[step][0]) for share in shares)) for step in range(steps)
        ]
        assert sorted(i for share in shares for i in ids(share.rows)) == list(range(len(WIDTHS)))
    assert per_step["budget"] == per_step["padded budget"] == per_step["fixed"]


def test_token_budget_shares_are_planned_micro_batches() -> None:
    rows = numbered_rows(WIDTHS)
    shares = [split_rows(rows, 3, rank, trainer(steps=2, budget=60)) for rank in range(3)]
    for step in range(2):
        assert len({len(share.micro_batch_sizes[step]) for share in shares}) == 1, "unequal forward passes"
    for share in shares:
        for mb in share.rows.micro_batches(share.all_micro_batch_sizes):
            assert mb.tokens.numel() <= 60
            # Each micro-batch is cut to its longest row, and that row carries real tokens up to its end.
            assert mb.loss_mask[:, -1].any()
    assert len({size for share in shares for size in share.all_micro_batch_sizes}) > 1, (
        "rows per micro-batch vary"
    )


def test_token_budget_shares_count_the_sequence_padding() -> None:
    # Eight 300-token rows on two ranks, a 1000-token budget, micro-batches padded to 128 (FP8 at TP 8 with
    # sequence parallelism): rows cost 384, so two per micro-batch (768), four micro-batches of two rows.
    # Counting 300 per row would pack three (900 real, 1152 computed).
    rows = numbered_rows([300] * 8)
    shares = [split_rows(rows, 2, rank, trainer(steps=1, budget=1000), multiple=128) for rank in range(2)]
    assert [share.micro_batch_sizes for share in shares] == [[[2, 2]], [[2, 2]]]
    for share in shares:
        for mb in share.rows.micro_batches(share.all_micro_batch_sizes):
            assert mb.tokens.shape[0] * padded_length(mb.tokens.shape[1], 128) <= 1000


def test_micro_batches_follow_the_sizes_and_an_empty_one_adds_nothing() -> None:
    rows = numbered_rows([4, 7, 2])
    rows.response_mask[0, 0] = (
        1.0  # a one-token prompt: the token the placeholder borrows is a response token
    )
    micro = rows.micro_batches([2, 0, 1])
    assert [tuple(mb.tokens.shape) for mb in micro] == [(2, 7), (1, 1), (1, 2)]
    assert micro[2].advantages.tolist() == [2.0]
    # The placeholder for an empty micro-batch: its loss, unit count and gradient are zero.
    layout = SimpleNamespace(tp_size=1, tp_group=None)
    loss_fn = dapo_loss_fn(AlgoConfig(), layout, vocab_size=97, temperature=1.0)
    logits = torch.randn(1, 1, 97, requires_grad=True)
    loss_sum, units, _ = loss_fn(micro[1], logits)
    loss_sum.backward()
    assert float(loss_sum.detach()) == 0.0 and int(units) == 0
    assert torch.count_nonzero(logits.grad) == 0


def test_micro_batch_sizes_from_a_size_or_a_plan() -> None:
    assert micro_batch_sizes(5, 2) == [2, 2, 1]
    assert micro_batch_sizes(5, [3, 0, 2]) == [3, 0, 2]
    with pytest.raises(ValueError, match="do not add up to the 5 rows"):
        micro_batch_sizes(5, [3, 1])


def test_budget_below_the_longest_row_is_a_config_error() -> None:
    job = C.load([])
    longest = job.rollout.max_prompt_length + job.rollout.max_response_length
    with pytest.raises(C.ConfigError, match=f"trainer.max_tokens_per_micro_batch={longest - 1} cannot hold"):
        C.load([f"trainer.max_tokens_per_micro_batch={longest - 1}"])
    assert (
        C.load([f"trainer.max_tokens_per_micro_batch={longest}"]).trainer.max_tokens_per_micro_batch
        == longest
    )
    with pytest.raises(C.ConfigError, match="max_tokens_per_micro_batch must be >= 0"):
        C.load(["trainer.max_tokens_per_micro_batch=-1"])


def lagged_group(key: str, versions: list[str]) -> ScoredGroup:
    return ScoredGroup(
        key, [ScoredSample([1], [2], [-0.1], "stop", 1.0, True, weight_version=v) for v in versions]
    )


def test_policy_lag_counts_updates_since_the_sampling_weights() -> None:
    """Trained at step 5's weights: a fresh group (step-5) lags 0, one generated ahead (step-4) 1, one carried
    over from before (step-3) 2; three samples of four lag."""
    groups = [lagged_group("a", ["step-5", "step-4"]), lagged_group("b", ["step-3", "step-4"])]
    assert sample_lags(groups, 5) == [0, 1, 2, 1]
    metrics = policy_lag(groups, 5)
    assert metrics.pop("policy_lag/lagged_fraction") == 0.75
    assert sorted(metrics.values()) == [0.0, 1.0, 2.0]  # min, mean, max
    assert policy_lag([lagged_group("a", ["step-5", "step-5"])], 5)["policy_lag/lagged_fraction"] == 0.0
    # A sample whose lag cannot be known (an engine that reports no version) or that claims newer weights
    # than the policy's would get the wrong correction: refused, naming the version.
    for bad in ("None", "step-6"):
        with pytest.raises(ValueError, match=f"weight version '{bad}', not step-N with N <= 5"):
            sample_lags([lagged_group("a", ["step-5", bad])], 5)


def test_rows_carry_their_lag_to_every_micro_batch() -> None:
    """build_rows records each sample's lag in group order; splitting over ranks, steps and token-budget
    micro-batches moves each row's lag with it (row i: advantage i, lag i % 3)."""
    groups = [lagged_group("a", ["step-3", "step-2"]), lagged_group("b", ["step-1", "step-3"])]
    algo = AlgoConfig(overlong_buffer_length=2)
    rows, _ = build_rows(groups, algo, max_response_length=4, pad_token_id=0, trained_step=3)
    assert rows.lag.tolist() == [0, 1, 2, 0] and rows.any_lagged
    assert build_rows(groups, algo, max_response_length=4, pad_token_id=0)[0].lag is None

    rows = numbered_rows(WIDTHS)
    rows.lag = torch.arange(len(WIDTHS)) % 3
    for rank in range(2):
        share = split_rows(rows, 2, rank, trainer(steps=2, budget=60))
        for mb in share.rows.micro_batches(share.all_micro_batch_sizes):
            assert mb.lag.tolist() == [int(a) % 3 for a in mb.advantages]


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_build_rows_lays_out_rewards_advantages_and_the_overlong_filter(overlong_filter: bool) -> None:
    """Hand-computed: max response 4 tokens, a 2-token overlong buffer, so a 3-token response loses 0.5 and a
    4-token (truncated) one 1.0; GRPO normalises within each group."""
    algo = AlgoConfig(overlong_buffer_length=2, overlong_filter=overlong_filter)
    right = ScoredSample([5, 6], [7, 8], [-0.1, -0.2], "stop", 1.0, True)
    wordy = ScoredSample([5, 6], [7, 8, 9], [-0.3, -0.4, -0.5], "stop", 1.0, True)
    cut = ScoredSample([5], [7, 8, 9, 9], [-0.6, -0.7, -0.8, -0.9], "length", -1.0, False)
    rows, metrics = build_rows(
        [ScoredGroup("a", [right, wordy]), ScoredGroup("b", [cut, right])],
        algo,
        max_response_length=4,
        pad_token_id=0,
    )
    assert rows.tokens.tolist() == [[5, 6, 7, 8, 0], [5, 6, 7, 8, 9], [5, 7, 8, 9, 9], [5, 6, 7, 8, 0]]
    # Shaped rewards 1, 0.5 | -2, 1: each group's two rewards normalised by their std (sqrt(2)/2 x gap).
    half = 1 / 2**0.5
    torch.testing.assert_close(rows.advantages, torch.tensor([half, -half, -half, half]), atol=1e-4, rtol=0)
    cut_row = [0.0, 0.0, 0.0, 0.0] if overlong_filter else [1.0, 1.0, 1.0, 1.0]
    assert rows.response_mask.tolist() == [[0, 1, 1, 0], [0, 1, 1, 1], cut_row, [0, 1, 1, 0]]
    torch.testing.assert_close(rows.rollout_log_prob[2], torch.tensor([-0.6, -0.7, -0.8, -0.9]))
    torch.testing.assert_close(rows.rollout_log_prob[1], torch.tensor([0.0, -0.3, -0.4, -0.5]))
    # verl's names: shaped rewards 1, 0.5, -2, 1; scores 1, 1, -1, 1; response lengths 2, 3, 4, 2 (one cut);
    # prompt lengths 2, 2, 1, 2; advantages weighted by response length: (2h - 3h - 4h + 2h) / 11.
    assert metrics == pytest.approx(
        {
            "critic/score/mean": 0.5,
            "critic/score/max": 1.0,
            "critic/score/min": -1.0,
            "critic/rewards/mean": 0.125,
            "critic/rewards/max": 1.0,
            "critic/rewards/min": -2.0,
            "critic/advantages/mean": -3 * half / 11,
            "critic/advantages/max": half,
            "critic/advantages/min": -half,
            "response_length/mean": 11 / 4,
            "response_length/max": 4.0,
            "response_length/min": 2.0,
            "response_length/clip_ratio": 0.25,
            "prompt_length/mean": 7 / 4,
            "prompt_length/max": 2.0,
            "prompt_length/min": 1.0,
            "rollout/accuracy": 0.75,
            "perf/total_num_tokens": 18.0,
        },
        abs=1e-4,
    )


def test_an_unfilled_batch_trains_in_as_many_steps_as_give_every_rank_a_row() -> None:
    # 4 optimizer steps per rollout step but 3 rows (a small group kept under on_unfilled_batch=train).
    rows = PolicyRows(
        tokens=torch.ones(3, 5, dtype=torch.long), response_mask=torch.ones(3, 4), advantages=torch.ones(3)
    )
    for budget, two_ranks in ((None, [[[1]], [[2]]]), (100, [[[2]], [[1]]])):
        config = TrainerConfig(
            train_batch_size=4, ppo_mini_batch_size=1, micro_batch_size=2, max_tokens_per_micro_batch=budget
        )
        assert split_rows(rows, 1, 0, config).micro_batch_sizes == [[1], [1], [1]]
        # Two ranks: one step, every row trained once (a budget packs the longer share's rows together).
        assert [split_rows(rows, 2, rank, config).micro_batch_sizes for rank in range(2)] == two_ranks
        with pytest.raises(ValueError, match="3 sequences cannot give each of 4 data-parallel ranks one"):
            split_rows(rows, 4, 0, config)
