"""Prompt tokens: chat-template rendering, the plain-text fallback, and the prompt length limit's
truncate, drop and error modes."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron.data import char_tokenizer
from dapo_megatron.data.errors import DatasetError
from dapo_megatron.data.loading import build_dataset
from dapo_megatron.data.prompt_tokens import encode_prompt, render_prompt, tokenize_examples
from dapo_megatron.data.stats import DatasetStats
from dapo_megatron.records import PromptExample
from tests.sample_files import dapo_rows, write_jsonl

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def plain_tokenizer():
    return char_tokenizer.build()


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = char_tokenizer.build()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_chat_template_path(chat_tokenizer) -> None:
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"})
    text = render_prompt(messages, chat_tokenizer)
    assert text == "<system>Be brief.\n<user>1+1?\n<assistant>"
    assert encode_prompt(messages, chat_tokenizer) == char_tokenizer.encode(text)
    assert render_prompt(messages, chat_tokenizer, use_chat_template=False) == "Be brief.\n\n1+1?"


def test_no_template_fallback_is_the_plain_content(plain_tokenizer) -> None:
    assert plain_tokenizer.chat_template is None
    prompt = "Solve: 37+45=? "
    assert encode_prompt(({"role": "user", "content": prompt},), plain_tokenizer) == char_tokenizer.encode(
        prompt
    )


def test_build_dataset_with_template_truncates_from_the_left(tmp_path: Path, chat_tokenizer) -> None:
    # DAPO's prompt wraps each problem in ~280 characters: at one token a character, 300 cut the longer ones.
    path = write_jsonl(tmp_path / "dapo.jsonl", dapo_rows())
    dataset = build_dataset(path, chat_tokenizer, max_prompt_length=300, shuffle=False)
    assert len(dataset) == 3 and 0 < dataset.stats.too_long_truncated < 3
    assert dataset.stats.longest_prompt_tokens > 300
    for example in dataset:
        rendered = render_prompt(example.messages, chat_tokenizer)
        assert example.prompt_ids == tuple(char_tokenizer.encode(rendered)[-300:])
        assert rendered.endswith("<assistant>")


def test_overlong_modes_drop_truncate_error(plain_tokenizer) -> None:
    rows = [
        PromptExample(
            uid=str(n),
            prompt="ab" * n,
            ground_truth="1",
            data_source="s",
            messages=({"role": "user", "content": "ab" * n},),
            origin=f"f, line {n}",
        )
        for n in (2, 5, 8)
    ]
    dropped = DatasetStats()
    kept = tokenize_examples(
        rows, plain_tokenizer, max_prompt_length=10, overlong_prompt="drop", stats=dropped
    )
    assert [e.uid for e in kept] == ["2", "5"] and (dropped.too_long_dropped, dropped.final_size) == (1, 2)
    truncated = DatasetStats()
    kept = tokenize_examples(rows, plain_tokenizer, max_prompt_length=10, stats=truncated)
    assert char_tokenizer.decode(list(kept[2].prompt_ids)) == ("ab" * 8)[-10:]  # the end survives
    assert kept[1].prompt_ids == tuple(char_tokenizer.encode("ab" * 5))
    assert (truncated.too_long_truncated, truncated.final_size, truncated.longest_prompt_tokens) == (1, 3, 16)
    with pytest.raises(DatasetError, match=r"f, line 8: prompt is 16 tokens, over max_prompt_length=10"):
        tokenize_examples(rows, plain_tokenizer, max_prompt_length=10, overlong_prompt="error")
