"""Optimizer and training-loop settings owned by the actor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    optimizer: str = "adam"
    """megatron-core optimizer name; `adam` with weight decay is AdamW (decoupled)."""
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    """Linear warm-up length in optimizer steps."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer must be adam or sgd; got {self.optimizer!r}.")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0; got {self.lr}.")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, optim.lr={self.lr}]; got {self.min_lr}.")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0; got {self.lr_warmup_steps}.")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0; got {self.weight_decay}.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1); got {getattr(self, name)}.")
        if self.clip_grad < 0:
            raise ValueError(f"optim.clip_grad must be >= 0 (0 disables clipping); got {self.clip_grad}.")


@dataclass
class WarmupConfig:
    """Supervised warm-up that teaches a from-scratch demo model the answer format before RL
    (the DAPO paper starts from a pretrained base model instead; real recipes disable this)."""

    enabled: bool = True
    max_steps: int = 1500
    batch_size: int = 64
    micro_batch_size: int = 32
    lr: float = 3e-3
    target_accuracy: float = 0.15
    """Stop once greedy held-out accuracy reaches this. Accuracy rises steeply once it starts, so a
    measured stopping point gives RL the same starting difficulty on every machine and seed."""
    eval_every: int = 50
    eval_size: int = 200
    max_new_tokens: int = 12

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "micro_batch_size", "eval_every", "eval_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmup.{name} must be >= 1; got {getattr(self, name)}.")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"warmup.batch_size ({self.batch_size}) must be a multiple of "
                             f"warmup.micro_batch_size ({self.micro_batch_size}).")
        if not 0 < self.target_accuracy <= 1:
            raise ValueError(f"warmup.target_accuracy must be in (0, 1]; got {self.target_accuracy}.")
        if self.lr <= 0:
            raise ValueError(f"warmup.lr must be > 0; got {self.lr}.")
