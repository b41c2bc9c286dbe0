"""Turning prompts into token ids: the chat template (or plain text without one) and the prompt length
limit.

:func:`encode_prompt` renders the messages with the tokenizer's chat template and
``add_generation_prompt=True`` when ``tokenizer.chat_template`` is set; otherwise the message contents
joined by a blank line are tokenized as plain text. Prompts over ``max_prompt_length`` tokens are
truncated from the left (DAPO, via verl's ``truncation=left``), dropped, or raise, and
:class:`~dapo_megatron.data.stats.DatasetStats` counts each case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from dapo_megatron.data.config import OVERLONG_MODES
from dapo_megatron.data.errors import DatasetError
from dapo_megatron.data.stats import DatasetStats
from dapo_megatron.records import PromptExample

__all__ = ["PromptTokenizer", "encode_prompt", "render_prompt", "tokenize_examples"]


class PromptTokenizer(Protocol):
    """What the loader needs from a tokenizer; every Hugging Face tokenizer qualifies.

    A chat template is used when the object also has a truthy ``chat_template`` and an
    ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False) -> str``.
    """

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def _uses_template(tokenizer: PromptTokenizer, use_chat_template: bool) -> bool:
    return use_chat_template and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    messages: Sequence[Mapping[str, str]], tokenizer: PromptTokenizer, *, use_chat_template: bool = True
) -> str:
    """The prompt text the policy sees: the chat template's rendering, ending with the assistant
    header, or without a template the message contents joined by blank lines (one message: exactly
    its content, which is what the demo's character tokenizer needs)."""
    if _uses_template(tokenizer, use_chat_template):
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages],  # type: ignore[attr-defined]
            add_generation_prompt=True,
            tokenize=False,
        )
    return "\n\n".join(m["content"] for m in messages)


def encode_prompt(
    messages: Sequence[Mapping[str, str]], tokenizer: PromptTokenizer, *, use_chat_template: bool = True
) -> list[int]:
    """Token ids of :func:`render_prompt`'s text."""
    text = render_prompt(messages, tokenizer, use_chat_template=use_chat_template)
    # A chat template writes its own special tokens (BOS, role markers), so the tokenizer must not
    # add them a second time; plain text gets the tokenizer's usual ones, as in pretraining.
    return list(tokenizer.encode(text, add_special_tokens=not _uses_template(tokenizer, use_chat_template)))


def tokenize_examples(
    examples: Iterable[PromptExample],
    tokenizer: PromptTokenizer,
    *,
    max_prompt_length: int,
    overlong_prompt: str = "truncate_left",
    use_chat_template: bool = True,
    stats: DatasetStats | None = None,
) -> list[PromptExample]:
    """``examples`` with ``prompt_ids`` set and the length limit applied (``stats`` is updated).

    Left truncation keeps the end of the prompt, where the question and the generation header are,
    and drops the start of the chat template; that is what verl does for DAPO.

    Raises:
        DatasetError: with ``overlong_prompt="error"``, at the first prompt over the limit.
    """
    if overlong_prompt not in OVERLONG_MODES:
        raise DatasetError(f"unknown overlong_prompt {overlong_prompt!r}; expected one of {OVERLONG_MODES}")
    if max_prompt_length < 1:
        raise DatasetError(f"max_prompt_length must be >= 1; got {max_prompt_length}")
    stats = stats if stats is not None else DatasetStats()
    kept = []
    for example in examples:
        ids = encode_prompt(example.messages, tokenizer, use_chat_template=use_chat_template)
        stats.longest_prompt_tokens = max(stats.longest_prompt_tokens, len(ids))
        if len(ids) > max_prompt_length:
            if overlong_prompt == "error":
                raise DatasetError(
                    f"{example.origin}: prompt is {len(ids)} tokens, over max_prompt_length="
                    f"{max_prompt_length}. Fix: raise rollout.max_prompt_length, or set "
                    "data.overlong_prompt to truncate_left or drop."
                )
            if overlong_prompt == "drop":
                stats.too_long_dropped += 1
                continue
            stats.too_long_truncated += 1
            ids = ids[-max_prompt_length:]
        kept.append(replace(example, prompt_ids=tuple(ids)))
    stats.final_size = len(kept)
    return kept
