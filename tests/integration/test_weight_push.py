"""The weight-push protocol against a real SGLang engine, through both transports (shared-memory tensors
and a broadcast over a gloo group), and the check that catches ignored names.

SGLang answers `success: true` for tensor names it does not know and keeps its old weights (for Qwen2:
fused names such as `qkv_proj`). Only comparing log-probs exposes that, which is what `check_sync` does.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dapo_megatron import backends
from dapo_megatron.backends import cpu_weight_loader
from dapo_megatron.backends.cpu_weight_loader import named_views
from dapo_megatron.rollout.client import RolloutClient
from dapo_megatron.rollout.engine import SGLangEngine
from dapo_megatron.rollout.weight_sync import (
    UpdateGroup,
    WeightSyncError,
    bucket_nbytes,
    buckets,
    check_sync,
    flatten_bucket,
    post_all,
    push_bucket,
)
from tests.conftest import tiny_qwen2
from tests.integration.conftest import MAX_POSITIONS, engine_config, hf_log_probs

pytestmark = pytest.mark.sglang
SEQUENCES = [[40, 41, 42, 43, 44, 45, 46, 47], [50, 60, 70, 80, 90, 100, 110, 120]]
PROMPT = 3


@pytest.fixture(scope="module")
def new_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """Other random weights with the engine model's shapes."""
    return tiny_qwen2(
        tmp_path_factory.mktemp("new-weights"),
        vocab_size=128,
        num_layers=2,
        max_positions=MAX_POSITIONS,
        seed=99,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.1,
    )


METHODS = ["tensor", "distributed"]


def push(engine: SGLangEngine, named: list[tuple[str, torch.Tensor]], version: str, method: str) -> None:
    group = (
        UpdateGroup([engine.url], name="test-push", engine_tp_size=1, timeout_s=60)
        if method == "distributed"
        else None
    )
    try:
        post_all([engine.url], "/begin_weight_update", {}, timeout_s=60)
        for bucket in buckets(named, max_bytes=64 * 1024):  # several buckets
            if group is not None:
                group.push(flatten_bucket(bucket), version=version)
            else:
                push_bucket(
                    [engine.url], flatten_bucket(bucket), version=version, engine_tp_size=1, timeout_s=60
                )
        post_all([engine.url], "/end_weight_update", {}, timeout_s=60)
    finally:
        if group is not None:
            group.close()


def engine_and_expected(engine: SGLangEngine, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    client = RolloutClient(engine.url, engine_config())
    got = torch.tensor(client.teacher_forced_log_probs(SEQUENCES, [PROMPT] * len(SEQUENCES)))
    want = torch.tensor([hf_log_probs(model, s[:PROMPT], s[PROMPT:]) for s in SEQUENCES])
    client.close()
    return got, want


@pytest.mark.parametrize("method", METHODS)
def test_pushed_weights_serve_and_pass_the_check(
    engine: SGLangEngine, new_model: torch.nn.Module, method: str
) -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
    push(engine, list(new_model.state_dict().items()), f"{method}-1", method)
    got, want = engine_and_expected(engine, new_model)
    assert check_sync(want, got, torch.ones_like(got), tolerance=1e-4, version=f"{method}-1") < 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_unknown_names_are_accepted_but_caught_by_the_check(
    tiny_model_dir: Path, tmp_path: Path, new_model: torch.nn.Module, method: str
) -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
    with SGLangEngine(tiny_model_dir, engine_config(), log_file=tmp_path / "engine.log") as engine:
        fused = []  # what a naive sync might send: Megatron-style fused projections under HF-like names
        for name, tensor in new_model.state_dict().items():
            fused.append((name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj"), tensor))
        push(engine, fused, "fused-1", method)  # SGLang reports success ...
        got, want = engine_and_expected(engine, new_model)
    with pytest.raises(
        WeightSyncError, match="a weight was not loaded"
    ):  # ... but the weights did not change
        check_sync(want, got, torch.ones_like(got), tolerance=1e-4, version="fused-1")


def test_a_refused_broadcast_fails_at_once_and_retires_the_group(
    engine: SGLangEngine, new_model: torch.nn.Module
) -> None:
    """Outside a begin/end session the engine refuses the request and never joins the broadcast; the push must
    report that instead of waiting out the group's timeout, and the group must not be reused (our pending
    send would meet the engine's next receive)."""
    group = UpdateGroup([engine.url], name="test-refused", engine_tp_size=1, timeout_s=60)
    bucket = list(new_model.state_dict().items())[:2]
    try:
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="begin_weight_update"):
            group.push(flatten_bucket(bucket), version="refused")
        assert time.monotonic() - started < 30
        with pytest.raises(WeightSyncError, match="broken by an earlier failure"):
            group.push(flatten_bucket(bucket), version="refused")
    finally:
        group.close()


def test_cpu_loader_follows_shared_buffers_rewritten_in_place_or_replaced(
    engine: SGLangEngine, new_model: torch.nn.Module, tmp_path: Path
) -> None:
    """The CPU sync's engine-side loader keeps the shared memory it was sent mapped between updates (torch
    then reuses the mapping instead of opening the file again). What it serves must still be the latest
    content: of the same staging buffer rewritten in place, and of a new buffer that replaced it."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    other = tiny_qwen2(
        tmp_path / "other",
        vocab_size=128,
        num_layers=2,
        max_positions=MAX_POSITIONS,
        seed=7,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.1,
    )
    nbytes = bucket_nbytes(list(new_model.state_dict().items()))
    staging = backends.CPU.bucket_buffer(nbytes, torch.device("cpu"))
    for version, (model, buffer) in enumerate([(new_model, staging), (other, staging), (new_model, None)]):
        payload = flatten_bucket(list(model.state_dict().items()), buffer)  # None: a fresh shared buffer
        post_all([engine.url], "/begin_weight_update", {}, timeout_s=60)
        push_bucket(
            [engine.url],
            named_views(payload),
            version=f"loader-{version}",
            engine_tp_size=1,
            timeout_s=60,
            load_format=cpu_weight_loader.LOAD_FORMAT,
        )
        post_all([engine.url], "/end_weight_update", {}, timeout_s=60)
        got, want = engine_and_expected(engine, model)
        assert check_sync(want, got, torch.ones_like(got), tolerance=1e-4, version=f"loader-{version}") < 1e-4
