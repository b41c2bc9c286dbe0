"""dapo_megatron: DAPO reinforcement learning on megatron-core policies with SGLang rollouts.

Importing the package (and `dapo_megatron.algo`, `dapo_megatron.rewards`) must stay cheap: it never
imports megatron, transformers or SGLang. Those load only in the modules that need them. Which modules
must not import torch (a CPU trainer launches its engine before torch loads): tests/unit/test_torch_free.py.
"""

import warnings

# megatron-core repeats these on every rank when it is imported. Without Transformer Engine and apex (CPU,
# laptops) the torch fallbacks are what we want, and the CUDA-graph note concerns a default we don't use.
# Set here, before any module of the package imports megatron-core at its top; only megatron's own.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning, module=r"megatron\.")

__version__ = "0.1.0"
