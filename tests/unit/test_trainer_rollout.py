"""The driver's batch selection (trainer/collect.py): which prompt groups a training batch is made of when
groups complete out of order, the batch fills and the rest is aborted, and what the next step inherits.

The engine here is a scripted stand-in for `RolloutClient` that only decides completion order: the real
client against a real SGLang engine (streaming, aborts, partial samples) is tested in tests/integration.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from types import SimpleNamespace

import pytest

from dapo_megatron import config as job_config
from dapo_megatron.data import char_tokenizer
from dapo_megatron.records import Prompt, Sample
from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rewards.pool import RewardPool
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.batch import policy_lag, sample_lags
from dapo_megatron.trainer.collect import CollectCancelled, RolloutManager, UnfilledBatchError
from dapo_megatron.trainer.config import TrainerConfig
from dapo_megatron.trainer.rollout_side import RolloutSide

N = 4  # samples per prompt


def slow_and_mixed(number: int) -> tuple[float, list[bool]]:
    """Every third prompt takes ten times longer (long responses); every fifth is all correct."""
    duration = 10.0 if number % 3 == 0 else 1.0
    return duration, [True] * N if number % 5 == 4 else [True, False, False, True]


class ScriptedEngine:
    """Runs `slots` groups at a time on a simulated clock and completes them in order of their finish time;
    after `abort_all` the groups in flight come back aborted."""

    def __init__(self, slots: int, outcome: Callable[[int], tuple[float, list[bool]]]) -> None:
        self.slots, self.outcome = slots, outcome
        self.generated: Counter[int] = Counter()
        self.completed: Counter[int] = Counter()
        self.aborting = False
        self.version = "0"
        """The label of the weights it serves, as the fleet's weight sync sets it; samples carry it."""
        self.finished_with: dict[int, str] = {}
        """The version each prompt's group finished with."""

    def stream_groups(
        self, prompts: Iterable[tuple[Hashable, Sequence[int]]], *, n: int, **_: object
    ) -> Iterator[tuple[Hashable, list[Sample]]]:
        assert n == N
        pending, clock, in_flight = iter(prompts), 0.0, []
        self.aborting = False
        while True:
            while len(in_flight) < self.slots and not self.aborting:
                key, ids = next(pending, (None, None))
                if ids is None:
                    break
                self.generated[ids[0]] += 1
                heapq.heappush(in_flight, (clock + self.outcome(ids[0])[0], ids[0], key))
            if not in_flight:
                return
            clock, number, key = heapq.heappop(in_flight)
            self.completed[number] += 1
            self.finished_with[number] = self.version
            yield key, self._samples(key, number, aborted=False)
            if self.aborting:
                for _, number, key in in_flight:
                    yield key, self._samples(key, number, aborted=True)
                return

    def abort_all(self) -> None:
        self.aborting = True

    def _samples(self, key: Hashable, number: int, *, aborted: bool) -> list[Sample]:
        return [
            Sample(
                key, i, [number], [int(acc)], [-0.5], "abort" if aborted else "stop", self.version, "scripted"
            )
            for i, acc in enumerate(self.outcome(number)[1])
        ]


def manager(engine: ScriptedEngine, pool: RewardPool, **trainer: object) -> RolloutManager:
    prompts = (Prompt(uid=str(k), ids=[k], ground_truth="1", data_source="toy") for k in itertools.count())
    config = TrainerConfig(
        **{"train_batch_size": 4, "ppo_mini_batch_size": 4, "gen_batch_size": 8, **trainer}
    )
    return RolloutManager(
        engine,
        pool,
        prompts,
        rollout=RolloutConfig(n_samples_per_prompt=N),  # type: ignore[arg-type]
        trainer=config,
        decode=lambda ids: str(ids[0]),
        stop_token_ids=[],
        progress=False,
    )


@pytest.fixture
def pool() -> Iterator[RewardPool]:
    with RewardPool(RewardConfig(num_workers=0), lambda text, truth, _: {"acc": text == truth}) as scoring:
        yield scoring


def batches(rollouts: RolloutManager, steps: int) -> list[list[int]]:
    return [[int(group.key) for group in rollouts.collect()[0]] for _ in range(steps)]


INFORMATIVE = [k for k in range(100) if k % 5 != 4]


def test_streaming_batches_are_the_informative_prompts_in_draw_order(pool: RewardPool) -> None:
    """Slow groups are never passed over for fast ones, across steps no prompt is skipped, and a group that
    finished is never generated again (only the ones aborted in flight are)."""
    engine = ScriptedEngine(slots=6, outcome=slow_and_mixed)
    assert batches(manager(engine, pool), 5) == [INFORMATIVE[i : i + 4] for i in range(0, 20, 4)]
    assert engine.generated[0] == 1 and max(engine.generated.values()) > 1
    assert max(engine.completed.values()) == 1


@pytest.mark.parametrize("trainer", [{"carry_over": False}, {"max_carry_groups": 2}])
def test_without_carry_over_or_past_its_bound_the_tail_is_skipped_in_order(
    pool: RewardPool, trainer: dict[str, object]
) -> None:
    engine = ScriptedEngine(slots=6, outcome=slow_and_mixed)
    rollouts = manager(engine, pool, **trainer)
    trained, metrics = [], []
    for _ in range(4):
        groups, step_metrics = rollouts.collect()
        trained.append([int(group.key) for group in groups])
        metrics.append(step_metrics)
    flat = [k for batch in trained for k in batch]
    assert flat == sorted(flat) and set(flat) <= set(INFORMATIVE)  # in draw order, nothing twice
    assert trained[0] == INFORMATIVE[:4]

    # Nothing passed over: a batch is one run of consecutive informative prompts, or two when the two
    # prompts carried over precede the skipped ones.
    def runs(batch: list[int]) -> list[list[int]]:
        return [batch] if "carry_over" in trainer else [batch[:2], batch[2:]]

    for run in (run for batch in trained for run in runs(batch)):
        assert run == INFORMATIVE[INFORMATIVE.index(run[0]) : INFORMATIVE.index(run[0]) + len(run)]
    assert all(m["dynamic_sampling/skipped_prompts"] > 0 for m in metrics)
    assert max(m["dynamic_sampling/backlog_prompts"] for m in metrics) == (
        0 if "carry_over" in trainer else 2
    )
    assert max(engine.completed.values()) == 1


def test_streaming_and_batch_sync_pick_the_same_batches(pool: RewardPool) -> None:
    streamed = batches(manager(ScriptedEngine(6, slow_and_mixed), pool), 3)
    synced = batches(manager(ScriptedEngine(6, slow_and_mixed), pool, dynamic_sampling_mode="batch_sync"), 1)
    assert streamed[0] == synced[0]


def test_backlog_metrics_and_cost(pool: RewardPool) -> None:
    rollouts = manager(ScriptedEngine(6, slow_and_mixed), pool)
    _, first = rollouts.collect()
    assert first["dynamic_sampling/kept_groups"] == 4 and first["dynamic_sampling/carried_over"] == 0
    assert first["dynamic_sampling/backlog_prompts"] >= first["dynamic_sampling/backlog_groups"] > 0
    carried = first["dynamic_sampling/backlog_groups"]
    _, second = rollouts.collect()
    assert second["dynamic_sampling/carried_over"] == carried
    assert second["dynamic_sampling/samples_per_kept"] < first["dynamic_sampling/samples_per_kept"] + 1


@pytest.mark.parametrize("mode", ["streaming", "batch_sync"])
def test_samples_keep_the_weight_version_that_generated_them(pool: RewardPool, mode: str) -> None:
    """Each step the engine serves the weights pushed after the previous one. A group carries the version it
    finished with, so one carried over from a step k steps back lags k updates (aborted prompts are generated
    again, with the new weights). Streaming carries groups over; batch-synchronous (verl's, the paper
    recipes') never does, so nothing lags."""
    engine = ScriptedEngine(slots=6, outcome=slow_and_mixed)
    rollouts = manager(engine, pool, dynamic_sampling_mode=mode)
    lagged = 0
    for step in range(1, 6):
        engine.version = f"step-{step - 1}"
        groups, _ = rollouts.collect()
        expected = [step - 1 - int(engine.finished_with[int(g.key)].removeprefix("step-")) for g in groups]
        assert sample_lags(groups, step - 1) == [lag for lag in expected for _ in range(N)]
        assert policy_lag(groups, step - 1)["policy_lag/lagged_fraction"] == pytest.approx(
            sum(lag > 0 for lag in expected) / len(groups)
        )
        lagged += sum(lag > 0 for lag in expected)
    assert (lagged > 0) == (mode == "streaming")


@pytest.mark.parametrize("size", ["0.5b", "7b", "32b"])
def test_the_paper_recipes_sample_batch_synchronously(size: str) -> None:
    """The recipes named after the paper keep its semantics: nothing carried over, nothing generated ahead."""
    job = job_config.to_job_config(job_config.compose([f"experiment=dapo_qwen2.5_{size}"]))
    assert job.trainer.dynamic_sampling and job.trainer.dynamic_sampling_mode == "batch_sync"
    assert not job.trainer.overlap_rollout


def test_cancel_from_another_thread_stops_drawing_and_raises(pool: RewardPool) -> None:
    """What shutting down does to a batch generated ahead: the cancel (here issued while prompt 2 is being
    generated, as another thread would) aborts what is in flight, no further prompt is drawn, and collect
    raises instead of returning a short batch."""
    rollouts: RolloutManager

    def cancel_at_two(number: int) -> tuple[float, list[bool]]:
        if number == 2 and not rollouts._cancelled.is_set():
            rollouts.cancel()
        return slow_and_mixed(number)

    engine = ScriptedEngine(slots=2, outcome=cancel_at_two)
    rollouts = manager(engine, pool)
    with pytest.raises(CollectCancelled, match="cancelled"):
        rollouts.collect()
    assert engine.aborting and max(engine.generated) == 2


def test_without_dynamic_sampling_every_group_trains_and_the_informative_share_is_logged(
    pool: RewardPool,
) -> None:
    rollouts = manager(
        ScriptedEngine(6, slow_and_mixed),
        pool,
        dynamic_sampling=False,
        train_batch_size=10,
        ppo_mini_batch_size=10,
    )
    groups, metrics = rollouts.collect()
    assert sorted(int(group.key) for group in groups) == list(range(10))  # all-correct prompts 4 and 9 too
    assert metrics["dynamic_sampling/keep_ratio"] == pytest.approx(8 / 10)
    assert metrics["dynamic_sampling/drop_all_correct"] == 2  # judged, not dropped: the metric's name stays


def test_a_batch_dynamic_sampling_cannot_fill_stops_or_trains_as_configured(pool: RewardPool) -> None:
    """One generation round of 8 prompts, of which only prompt 3 is informative (the rest all correct): a
    batch of 4 groups cannot fill. By default that stops the job naming the fix; with
    on_unfilled_batch=train the one informative group trains; with nothing informative it stops either way."""

    def one_informative(number: int) -> tuple[float, list[bool]]:
        return 1.0, [True, False, True, False] if number == 3 else [True] * N

    def none_informative(number: int) -> tuple[float, list[bool]]:
        return 1.0, [False] * N

    settings = {"max_gen_rounds": 1, "dynamic_sampling_mode": "batch_sync"}
    with pytest.raises(
        UnfilledBatchError, match=r"1 of 4 informative groups .* trainer.on_unfilled_batch=train"
    ):
        manager(ScriptedEngine(4, one_informative), pool, **settings).collect()
    groups, metrics = manager(
        ScriptedEngine(4, one_informative), pool, on_unfilled_batch="train", **settings
    ).collect()
    assert [group.key for group in groups] == ["3"] and metrics["dynamic_sampling/gen_rounds"] == 1.0
    with pytest.raises(UnfilledBatchError, match="0 of 4 informative groups"):
        manager(ScriptedEngine(4, none_informative), pool, on_unfilled_batch="train", **settings).collect()


def test_reward_workers_started_before_the_engines_are_the_ones_that_score(tmp_path) -> None:
    """The session starts the reward workers while the engines start (their scorer imports take seconds);
    the rollout side then scores with those, not with a second pool."""
    job = job_config.to_job_config(job_config.compose(["experiment=demo", f"output_dir={tmp_path}"]))
    side = RolloutSide(job, SimpleNamespace(is_logging_rank=True), char_tokenizer.build())
    try:
        side.start_rewards()
        started = side.rewards
        assert started is not None
        side.start(["http://127.0.0.1:9"], on_error=lambda url: None)  # the client connects on first use
        assert side.rewards is started and side.manager is not None
        assert side.manager.rewards is started
        assert started.score([("Answer: 12", "12", "math_dapo")])[0].acc
    finally:
        side.close()


class CountingPrompts:
    """Prompts 0, 1, 2, ... with the resumable position of a real prompt source."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        self.position += 1
        number = self.position - 1
        return Prompt(uid=str(number), ids=[number], ground_truth="1", data_source="toy")

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def rollout_side(engine: ScriptedEngine, pool: RewardPool, state: dict | None = None) -> RolloutSide:
    side = RolloutSide(
        job_config.to_job_config(job_config.compose(["experiment=demo"])),
        SimpleNamespace(is_logging_rank=True),
        char_tokenizer.build(),
    )
    side.manager = manager(engine, pool, dynamic_sampling_mode="batch_sync")
    side.manager.prompts = CountingPrompts()
    if state is not None:
        side.manager.prompts.load_state_dict(state["prompts"])
        side.manager.backlog = state["backlog"]
    return side


def test_a_stop_request_aborts_the_generation_and_keeps_the_step_start(
    pool: RewardPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The time-limit stop between generation rounds: a stop request seen while a step generates aborts the
    requests in flight and the step returns no groups; what a checkpoint then keeps is the prompt stream as
    that step began, so the resumed job trains exactly the batch the stopped step would have trained."""
    from dapo_megatron.trainer import rollout_side as module

    monkeypatch.setattr(module, "STOP_POLL_S", 0.01)
    stop = threading.Event()

    def slow(number: int) -> tuple[float, list[bool]]:
        time.sleep(0.005)  # real time passes while a group generates: the watcher polls meanwhile
        if number == 14:
            stop.set()
        return slow_and_mixed(number)

    uninterrupted = rollout_side(ScriptedEngine(2, slow_and_mixed), pool)
    expected = [[int(g.key) for g in uninterrupted.collect()[0]] for _ in range(2)]

    engine = ScriptedEngine(2, slow)
    side = rollout_side(engine, pool)
    first, _ = side.collect(stop.is_set)
    assert [int(g.key) for g in first] == expected[0] and not stop.is_set()
    after_first = side.state_dict()
    assert side.collect(stop.is_set) == (None, {})
    assert engine.aborting  # the requests in flight were aborted
    assert (
        side.state_dict() == after_first
        and side.manager.prompts.position > after_first["prompts"]["position"]
    )

    resumed = rollout_side(ScriptedEngine(2, slow_and_mixed), pool, state=side.state_dict())
    assert [int(g.key) for g in resumed.collect()[0]] == expected[1]
