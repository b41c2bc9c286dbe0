"""The trainer's state to host memory and back (`trainer/offload.py`) on one gloo rank with real
megatron-core: every storage released in between, every byte back after, views and references intact."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conftest import REPO, load_script, one_gloo_rank

pytest.importorskip("megatron.core")
worker = load_script(REPO / "tests" / "distributed" / "resume_worker.py")


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with one_gloo_rank(tmp_path_factory.mktemp("gloo") / "store"):
        yield


@pytest.mark.parametrize(
    ("dtype", "distributed"),
    [("bfloat16", True), ("float32", False)],
    ids=["bf16_distributed_optimizer", "fp32"],
)
def test_a_round_trip_releases_every_storage_and_restores_every_byte(
    gloo: None, dtype: str, distributed: bool
) -> None:
    """bf16 with the distributed optimizer: bf16 and fp32 parameter buffers, fp32 main parameters, Adam's
    moments. fp32 without it: the parameters as separate tensors, the optimizer stepping them in place."""
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.planning.memory import stage_state_bytes
    from dapo_megatron.trainer.offload import TrainerStateOffload

    layout, model, actor = worker.build({"use_distributed_optimizer": distributed}, seed=7, dtype=dtype)
    offload = TrainerStateOffload(model, actor.optimizer)
    worker.train_step(actor, layout, 1, seeded=True)  # Adam's state exists from the first step
    worker.offload_round_trip(offload, model, actor.optimizer)
    assert not offload.offloaded and offload.host_bytes == 0

    # What moves is what the memory planner counts (plus Adam's step counters, which torch keeps on the host:
    # a device of its own would not move them).
    offload.offload()
    planned = stage_state_bytes(
        dataclasses.replace(worker.model_config(), params_dtype=dtype),
        ParallelConfig(use_distributed_optimizer=distributed),
        dp=1,
        pp_rank=0,
    )[0]
    step_counters = 4 * sum(len(p.optimizer.state) for p in actor.optimizer.chained_optimizers)
    assert offload.host_bytes == planned.total + step_counters
    offload.reload()

    # Training goes on through the same tensors: the step after the round trip changes the weights.
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    worker.train_step(actor, layout, 2, seeded=True)
    assert any(not torch.equal(param, before[name]) for name, param in model.named_parameters())


def test_the_state_is_resident_inside_resident_and_offloaded_again_after(gloo: None) -> None:
    from dapo_megatron.trainer.offload import TrainerStateOffload

    _, model, actor = worker.build({}, seed=7)
    offload = TrainerStateOffload(model, actor.optimizer)
    param = next(model.parameters())
    assert offload.offload() >= 0 and offload.offload() == 0.0  # idempotent
    with offload.resident():
        assert param.untyped_storage().nbytes() > 0
    assert offload.offloaded and param.untyped_storage().nbytes() == 0
    offload.reload()
    with offload.resident():
        pass
    assert not offload.offloaded


def test_storages_in_shared_memory_stay_where_the_cpu_engine_maps_them(gloo: None) -> None:
    """The CPU weight sync moves the parameters into shared memory once; the engine reads them there."""
    from dapo_megatron.trainer.offload import TrainerStateOffload

    _, model, actor = worker.build({}, seed=7)
    for param in model.parameters():
        param.data.share_memory_()
    offload = TrainerStateOffload(model, actor.optimizer)
    offload.offload()
    assert all(param.untyped_storage().nbytes() > 0 for param in model.parameters())
    assert all(buffer.grad_data.untyped_storage().nbytes() == 0 for buffer in model.buffers)
    offload.reload()


def test_offload_and_overlapped_rollouts_are_refused_together() -> None:
    from dapo_megatron.config import ConfigError, compose, to_job_config

    with pytest.raises(ConfigError, match=r"trainer\.offload_during_rollout .* trainer\.overlap_rollout"):
        to_job_config(
            compose(
                [
                    "trainer.offload_during_rollout=true",
                    "trainer.overlap_rollout=true",
                    "algo.old_log_prob_source=rollout",
                ]
            )
        )


def test_the_sync_offloads_after_the_trainers_probe_and_before_the_kv_cache_returns(gloo: None) -> None:
    """On GPUs the engine's KV cache comes back into the memory the trainer's state leaves: the push and the
    trainer's side of the probe need that state resident, the engines' side needs the KV cache. The fleet
    runs as on a GPU node (device "cuda": it releases and resumes the engine's memory); the engine, its
    weight sync and the rollout client are recorders, the model, optimizer, offload and probe are real."""
    from dapo_megatron import backends
    from dapo_megatron import config as job_config
    from dapo_megatron.trainer.fleet import EngineFleet
    from dapo_megatron.trainer.offload import TrainerStateOffload
    from dapo_megatron.trainer.sync_probe import SyncProbe

    _, model, actor = worker.build({}, seed=7)
    offload = TrainerStateOffload(model, actor.optimizer)
    param = next(model.parameters())
    events: list[str] = []

    def resident() -> str:
        return "resident" if param.untyped_storage().nbytes() > 0 else "offloaded"

    class Engine:
        def release_memory(self) -> None:
            events.append("engine releases")

        def resume_memory(self, tags: list[str]) -> None:
            events.append(f"engine resumes {'+'.join(tags)} (trainer {resident()})")

    class Sync:
        def sync(self, model: torch.nn.Module, version: str) -> None:
            events.append(f"push {version} (trainer {resident()})")

    probe = SyncProbe([[1, 2, 3], [4, 5]], [6, 7], pad_token_id=0)
    trainer_log_probs = actor.compute_log_probs(probe.rows, 2, temperature=1.0)

    class Client:
        urls = ("http://engine-0",)

        def teacher_forced_log_probs(
            self, sequences: list[list[int]], prompt_lengths: list[int], engine: int
        ) -> list[list[float]]:
            events.append("engine scores the probe")
            return [
                trainer_log_probs[row, length - 1 : len(sequence) - 1].tolist()
                for row, (sequence, length) in enumerate(zip(sequences, prompt_lengths, strict=True))
            ]

    original = actor.compute_log_probs

    def trainer_scores(*args: Any, **kwargs: Any) -> torch.Tensor:
        events.append(f"trainer scores the probe (trainer {resident()})")
        return original(*args, **kwargs)

    actor.compute_log_probs = trainer_scores
    job = job_config.load(["rollout.sync_check=always"], world_size=1)
    fleet = EngineFleet(
        job, rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", backend=backends.CUDA
    )
    fleet.engine, fleet.sync, fleet.probe = Engine(), Sync(), probe

    def offload_state() -> float:
        events.append("trainer offloads")
        return offload.offload()

    fleet.release_memory()
    offload.reload()
    report = fleet.sync_weights(actor, Client(), 3, offload=offload_state)
    assert events == [
        "engine releases",
        "engine resumes weights (trainer resident)",
        "push step-3 (trainer resident)",
        "trainer scores the probe (trainer resident)",
        "trainer offloads",
        "engine resumes kv_cache+cuda_graph (trainer offloaded)",
        "engine scores the probe",
    ]
    assert report.probe_gap == 0.0 and report.offload_seconds >= 0.0 and offload.offloaded
    offload.reload()
