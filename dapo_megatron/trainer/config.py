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
