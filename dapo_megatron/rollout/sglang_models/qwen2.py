"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): SGLang's own implementation, found without its registry."""

from sglang.srt.models.qwen2 import Qwen2ForCausalLM

EntryClass = Qwen2ForCausalLM
