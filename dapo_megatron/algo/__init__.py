"""DAPO algorithm maths: policy loss (`loss.py`), aggregation, GRPO advantages, reward shaping, log-probs.

Pure torch/numpy/stdlib: nothing here loads megatron, transformers, SGLang, OmegaConf or Hydra, so it can be
unit-tested on CPU and reused by any trainer. `config.py` does not import torch: the job's config holds
`AlgoConfig`, and a CPU trainer reads its config and launches its engine before it imports torch.
"""
