"""Load a model directory's tokenizer exactly as saved."""

from __future__ import annotations

from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(hf_dir: Path | str) -> PreTrainedTokenizerBase:
    """The tokenizer of `hf_dir`, with its `tokenizer.json` pipeline used verbatim.

    transformers 5's AutoTokenizer picks the tokenizer class from config.json's model_type and, for
    `qwen2`, rebuilds the pipeline as Qwen's byte-level BPE. For Qwen's own files that is the same thing;
    for any other tokenizer saved next to a Qwen2 architecture (the demo's character tokenizer) it silently
    changes the token ids (spaces vanish), and the policy would be trained on text it never saw.
    """
    if (Path(hf_dir) / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    # transformers resolves AutoTokenizer on first use (its model registry, ~1.4 s): only here.
    return transformers.AutoTokenizer.from_pretrained(str(hf_dir))
