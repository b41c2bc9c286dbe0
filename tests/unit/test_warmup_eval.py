"""The warm-up's teacher-forced accuracy (`warmup.eval_mode=teacher_forced`) accepts a completion exactly when
greedy decoding writes it: checked against the trainer's own greedy decoding on a random tiny policy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dapo_megatron.data import arithmetic, char_tokenizer
from tests.conftest import one_gloo_rank, tiny_policy

VOCAB = len(char_tokenizer.VOCAB)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[torch.nn.Module, object]]:
    """A random 2-layer Qwen2 on one gloo rank."""
    pytest.importorskip("megatron.core")
    with one_gloo_rank(tmp_path_factory.mktemp("gloo") / "store") as layout:
        yield tiny_policy(layout, vocab_size=128)[0], layout


def test_teacher_forcing_accepts_exactly_what_greedy_decoding_writes(
    policy: tuple[torch.nn.Module, object],
) -> None:
    from dapo_megatron.trainer.forward import greedy_generate
    from dapo_megatron.trainer.warmup import target_row, teacher_forced_exact

    model, layout = policy
    problems = arithmetic.problems("eval", task="column_addition")[:12]
    prompts = [char_tokenizer.encode(p.prompt) for p in problems]
    greedy = greedy_generate(
        model,
        prompts,
        layout,
        max_new_tokens=8,
        eos_token_id=char_tokenizer.EOS_ID,
        pad_token_id=char_tokenizer.PAD_ID,
        vocab_size=VOCAB,
    )

    def exact(rows: list[tuple[list[int], list[int]]]) -> list[bool]:
        # Micro-batches of 5: three of them, of different widths.
        return teacher_forced_exact(model, rows, layout, vocab_size=VOCAB, micro_batch_size=5)

    assert exact(list(zip(prompts, greedy, strict=True))) == [True] * 12
    # One token off, at the end or the start of the completion: rejected.
    assert (
        exact([(p, [*c[:-1], (c[-1] + 1) % VOCAB]) for p, c in zip(prompts, greedy, strict=True)])
        == [False] * 12
    )
    assert (
        exact([(p, [(c[0] + 1) % VOCAB, *c[1:]]) for p, c in zip(prompts, greedy, strict=True)])
        == [False] * 12
    )
    # An untrained policy writes none of the worked targets.
    assert not any(exact([target_row(p) for p in problems]))
