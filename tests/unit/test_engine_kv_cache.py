"""A CPU engine's KV cache against the requests the client keeps in flight: a cache too small for them makes
SGLang queue and retract, so the engine warns, naming the setting that fixes it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from dapo_megatron import backends
from dapo_megatron import config as C
from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine

# The ~30M benchmark's requests under the demo's cache: 256 in flight, prompts up to 32 tokens, responses up
# to 128.
TIGHT = RolloutConfig(
    max_total_tokens=16384, max_concurrent_requests=256, max_prompt_length=32, max_response_length=128
)


def test_a_cache_that_holds_every_request_at_full_length_is_enough() -> None:
    fits = RolloutConfig(
        max_total_tokens=256 * 160, max_concurrent_requests=256, max_prompt_length=32, max_response_length=128
    )
    assert fits.kv_shortfall() is None
    assert RolloutConfig().kv_shortfall() is None
    assert C.load(["experiment=demo"]).rollout.kv_shortfall() is None


def test_the_shortfall_says_how_many_fit_and_what_to_set() -> None:
    message = TIGHT.kv_shortfall()
    assert message is not None
    assert "holds 102 of rollout.max_concurrent_requests=256 requests of up to 160 tokens" in message
    assert "Set rollout.max_total_tokens=40960" in message


def test_a_cpu_engine_warns_at_construction_and_a_gpu_engine_does_not(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"rollout.max_total_tokens=16384 holds 102 of"):
        SGLangEngine("model", TIGHT, log_file=tmp_path / "engine.log", backend=backends.CPU)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # on GPUs the memory fraction sizes the cache; max_total_tokens is unused
        SGLangEngine("model", TIGHT, log_file=tmp_path / "engine.log", backend=backends.CUDA)
