"""Installed versions of the packages whose versions decide behaviour, as the start-up banner, FP8's
environment check and `tools/gpu_check.py` report them."""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata

PACKAGES = {
    "torch": (("torch",), "torch"),
    "megatron-core": (("megatron-core", "megatron_core"), "megatron.core"),
    "SGLang": (("sglang",), "sglang"),
    "TE": (("transformer-engine", "transformer_engine", "transformer-engine-torch"), "transformer_engine"),
}
"""Label -> (its distribution names, its module)."""


def package_version(label: str) -> str | None:
    """The installed version of `PACKAGES[label]`, None when it is not installed. Package metadata first:
    importing SGLang or Transformer Engine to ask costs seconds. The module's `__version__` second: NVIDIA's
    containers build TE and megatron-core from source, sometimes without metadata."""
    distributions, module = PACKAGES[label]
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except ModuleNotFoundError:  # the parent package (`megatron`) is absent
        return None
    return getattr(importlib.import_module(module), "__version__", "unknown")
