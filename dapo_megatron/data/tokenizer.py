"""Load a model directory's tokenizer exactly as saved."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(hf_dir: Path | str) -> PreTrainedTokenizerBase:
    """The tokenizer of `hf_dir`, with its `tokenizer.json` pipeline used verbatim.

    transformers 5's AutoTokenizer picks the tokenizer class from config.json's model_type and, for
    `qwen2`, rebuilds the pipeline as Qwen's byte-level BPE. For Qwen's own files that is the same thing;
    for any other tokenizer saved next to a Qwen2 architecture (the demo's character tokenizer) it silently
    changes the token ids (spaces vanish), and the policy would be trained on text it never saw.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (Path(hf_dir) / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    return AutoTokenizer.from_pretrained(str(hf_dir))
