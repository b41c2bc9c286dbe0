"""Fixtures for tests against a real SGLang server on CPU: a tiny Qwen2 with a character tokenizer, its
Hugging Face twin for reference log-probs, and helpers to start engines and inspect their processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from dapo_megatron.rollout.config import RolloutConfig
from dapo_megatron.rollout.engine import SGLangEngine
from tests.conftest import tiny_qwen2

# Long enough for generations that are still running when a test aborts them (a few thousand tokens
# take several seconds on two cores) while the KV cache stays a few MB.
MAX_POSITIONS = 4096


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 whose logits are far from uniform, so that a misaligned or mis-tempered
    log-prob cannot pass a 1e-4 comparison by accident."""
    from dapo_megatron.data import char_tokenizer

    out = tmp_path_factory.mktemp("tiny-qwen2")
    char_tokenizer.save(out)
    tiny_qwen2(
        out,
        vocab_size=128,
        num_layers=2,
        max_positions=MAX_POSITIONS,
        seed=1234,
        eos_token_id=1,
        pad_token_id=0,
        initializer_range=0.1,
    )
    return out


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def engine_config(**overrides: object) -> RolloutConfig:
    """Settings sized for the tiny model on a 2-core machine."""
    defaults: dict[str, object] = {
        "dtype": "float32",
        "max_total_tokens": 16384,
        "startup_timeout_s": 180.0,
        "request_timeout_s": 120.0,
        "max_concurrent_requests": 64,
    }
    return RolloutConfig(**(defaults | overrides))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangEngine]:
    """One real SGLang server per test module; tests that kill or stop a server start their own."""
    log_file = tmp_path_factory.mktemp("sglang-logs") / "engine.log"
    with SGLangEngine(tiny_model_dir, engine_config(), log_file=log_file) as started:
        yield started


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and all its descendants that are still running (zombies count as gone)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    return [p for p in tree if alive(p)]


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def hf_log_probs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / T) of each output token given everything before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].double()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return log_probs[positions, torch.tensor(output, dtype=torch.long)].tolist()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation that ignores EOS, like SGLang with temperature 0 and ignore_eos."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
