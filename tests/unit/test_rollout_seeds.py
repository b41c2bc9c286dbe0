"""Per-sample sampling seeds (rollout.deterministic): what the client sends, and that a resumed step and a
repeated evaluation ask for the same seeds.

The engine is a stand-in HTTP server that answers `/generate` in SGLang's response shape and records the
request bodies: what it would do with the seeds (SGLang's deterministic inference) needs a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from dapo_megatron import config as C
from dapo_megatron.data import char_tokenizer
from dapo_megatron.rewards.config import RewardConfig
from dapo_megatron.rewards.pool import RewardPool
from dapo_megatron.rollout.client import RolloutClient, sample_seed
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.trainer.collect import RolloutManager
from dapo_megatron.trainer.config import EvalConfig, TrainerConfig
from dapo_megatron.trainer.evaluate import evaluate
from dapo_megatron.trainer.prompts import build_prompt_sources
from tests.conftest import JsonHandler, local_http_server


class GenerateHandler(JsonHandler):
    """Sample i of a request answers token i % 2 with finish reason stop; every body is recorded."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/generate":
            self.server.bodies.append(body)  # type: ignore[attr-defined]
            answer: Any = [
                {
                    "output_ids": [i % 2],
                    "meta_info": {
                        "id": rid,
                        "finish_reason": {"type": "stop"},
                        "output_token_logprobs": [[-0.5, i % 2, None]],
                        "weight_version": "0",
                    },
                }
                for i, rid in enumerate(body["rid"])
            ]
        else:
            answer = {}
        self.reply_json(answer)


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    with local_http_server(GenerateHandler, bodies=[]) as httpd:
        yield httpd


@pytest.fixture
def pool() -> Iterator[RewardPool]:
    # Half of every group right (sample i answers i % 2): each group is informative to dynamic sampling.
    with RewardPool(RewardConfig(num_workers=0), lambda text, truth, _: {"acc": text == "1"}) as scoring:
        yield scoring


def url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def seeds_by_prompt(server: ThreadingHTTPServer) -> dict[tuple[int, ...], list[int]]:
    """The seeds the recorded requests asked for, by prompt (one request per group)."""
    return {
        tuple(body["input_ids"][0]): [params["sampling_seed"] for params in body["sampling_params"]]
        for body in server.bodies
    }  # type: ignore[attr-defined]


def test_sample_seed_is_a_fixed_function_of_its_parts() -> None:
    # A literal: a changed derivation would give a resumed run other samples than the run it continues.
    assert sample_seed(1234, "eval", 0, "uid-0", 3) == 8487853770310895944
    seeds = {sample_seed(1234, "eval", index, 0) for index in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(1, 2) != sample_seed(12) and sample_seed(1, 2) == sample_seed("1", "2")


def test_the_client_seeds_each_sample_only_when_asked(server: ThreadingHTTPServer) -> None:
    with RolloutClient(url(server), RolloutConfig()) as client:
        list(client.stream_groups([("a", [5, 6])], n=3, group_seed=lambda key: 77))
        list(client.stream_groups([("b", [5, 6])], n=3))
    seeded, plain = server.bodies  # type: ignore[attr-defined]
    assert [params["sampling_seed"] for params in seeded["sampling_params"]] == [
        sample_seed(77, i) for i in range(3)
    ]
    assert {k: v for k, v in seeded["sampling_params"][0].items() if k != "sampling_seed"} == plain[
        "sampling_params"
    ]
    assert "sampling_seed" not in plain["sampling_params"]
    with RolloutClient(url(server), RolloutConfig(deterministic=True)) as client:
        with pytest.raises(
            ValueError, match=r"needs a group_seed .* all samples of a prompt would be identical"
        ):
            client.stream_groups([("c", [5, 6])], n=3)
        list(client.stream_groups([("greedy", [5, 6])], n=1, temperature=0.0))  # greedy needs no seed


def rollouts(server: ThreadingHTTPServer, pool: RewardPool, state: dict[str, Any] | None) -> RolloutManager:
    """batch_sync dynamic sampling over the demo's prompts, continued from `state` if given."""
    job = C.load(["experiment=demo"])
    train, _ = build_prompt_sources(job, char_tokenizer.build())
    if state is not None:
        train.load_state_dict(state)
    rollout = RolloutConfig(n_samples_per_prompt=2, deterministic=True, seed=job.seed)
    trainer = TrainerConfig(
        train_batch_size=2, ppo_mini_batch_size=2, gen_batch_size=3, dynamic_sampling_mode="batch_sync"
    )
    client = RolloutClient(url(server), rollout)
    return RolloutManager(
        client,
        pool,
        train,
        rollout=rollout,
        trainer=trainer,
        decode=lambda ids: str(ids[0]),
        stop_token_ids=[],
        progress=False,
    )


def test_a_resumed_batch_sync_step_asks_for_the_seeds_of_the_original(
    server: ThreadingHTTPServer, pool: RewardPool
) -> None:
    original = rollouts(server, pool, state=None)
    original.collect()
    state = original.prompts.state_dict()  # what a checkpoint after the first step holds
    first = seeds_by_prompt(server)
    server.bodies.clear()  # type: ignore[attr-defined]
    original.collect()
    second = seeds_by_prompt(server)
    server.bodies.clear()  # type: ignore[attr-defined]
    rollouts(server, pool, state=state).collect()
    assert seeds_by_prompt(server) == second
    all_seeds = [s for seeds in [*first.values(), *second.values()] for s in seeds]
    assert len(all_seeds) == len(set(all_seeds)) == 2 * (len(first) + len(second))  # no seed used twice


def test_a_deterministic_evaluation_repeats_its_seeds(server: ThreadingHTTPServer, pool: RewardPool) -> None:
    job = C.load(["experiment=demo"])
    _, problems = build_prompt_sources(job, char_tokenizer.build())
    cfg = EvalConfig(num_problems=4, samples_per_problem=2)

    def run(rollout: RolloutConfig) -> dict[tuple[int, ...], list[int]]:
        server.bodies.clear()  # type: ignore[attr-defined]
        with RolloutClient(url(server), rollout) as client:
            evaluate(
                client,
                problems[:4],
                pool,
                cfg,
                decode=lambda ids: str(ids[0]),
                max_new_tokens=4,
                stop_token_ids=[],
            )
        return seeds_by_prompt(server) if isinstance(server.bodies[0]["sampling_params"], list) else {}  # type: ignore[attr-defined]

    seeded = run(RolloutConfig(deterministic=True, seed=7))
    assert len(seeded) == 4 and seeded == run(RolloutConfig(deterministic=True, seed=7))
    assert seeded != run(RolloutConfig(deterministic=True, seed=8))
    assert run(RolloutConfig(seed=7)) == {}
