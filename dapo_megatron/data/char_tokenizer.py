"""A character-level tokenizer for the laptop demo, saved in Hugging Face format.

One token per printable ASCII character plus three special tokens. Saved with `save_pretrained`, so
`transformers.AutoTokenizer` and SGLang load it like any other model's tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c\r"]
VOCAB = [PAD, EOS, UNK, *CHARACTERS]
PAD_ID, EOS_ID = VOCAB.index(PAD), VOCAB.index(EOS)


def build() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab={token: i for i, token in enumerate(VOCAB)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    core.decoder = decoders.Fuse()  # characters join back without separators
    core.add_special_tokens([PAD, EOS, UNK])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def encode(text: str) -> list[int]:
    """Token ids without building the tokenizer (the mapping is one id per character)."""
    return [VOCAB.index(c) if c in CHARACTERS else VOCAB.index(UNK) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if VOCAB[i] not in (PAD, EOS, UNK))


def save(out_dir: Path | str) -> Path:
    build().save_pretrained(str(out_dir))
    return Path(out_dir)
