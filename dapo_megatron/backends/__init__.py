"""Device backends: one object per device that engine, weight sync, model and trainer code ask
(`backends/base.py` says what it answers).

Importing them does not import torch (their methods that need it import it when called), and `detect()`
finds this machine's without importing torch where no GPU is visible: a CPU trainer launches its engine
before torch loads (`train.py`), and the memory planner (`dapo-plan-memory`) plans a GPU cluster without it.
"""

from __future__ import annotations

import os
from pathlib import Path

from dapo_megatron.backends.base import Backend
from dapo_megatron.backends.cpu import CpuBackend
from dapo_megatron.backends.cuda import CudaBackend

CPU: Backend = CpuBackend()
CUDA: Backend = CudaBackend()
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
"""One entry per GPU the NVIDIA driver sees (inside a container too, where the GPUs are mounted)."""


def named(name: str) -> Backend:
    """The backend of torch device type `name` (`cpu`, `cuda`)."""
    if name == "cpu":
        return CPU
    if name == "cuda":
        return CUDA
    raise ValueError(f"no backend for device {name!r}; choose cpu or cuda")


def of(device: object) -> Backend:
    """The backend of a torch device (or of anything with a `type`, such as a tensor's `device`)."""
    return named(getattr(device, "type", str(device)))


def detect() -> Backend:
    """This machine's backend: CUDA where torch can use a GPU. Where the driver shows none (or
    CUDA_VISIBLE_DEVICES hides them all), CPU without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = visible is not None and visible.strip() in ("", "-1")
    if hidden or not (NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir())):
        return CPU
    import torch

    return CUDA if torch.cuda.is_available() else CPU
