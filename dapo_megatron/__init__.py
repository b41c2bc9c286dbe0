"""dapo_megatron: DAPO reinforcement learning on megatron-core policies with SGLang rollouts.

Importing the package (and `dapo_megatron.algo`, `dapo_megatron.rewards`) must stay cheap: it never
imports megatron, transformers or SGLang. Those load only in the modules that need them.
"""

__version__ = "0.1.0"
