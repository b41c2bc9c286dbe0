"""Start a real SGLang server on a CPU-only machine.

    python -m dapo_megatron.backends.sglang_cpu --model-path DIR --port 30000 [sglang server args]

SGLang imports two packages that have only CUDA builds on PyPI: `torchvision` (from multimodal code a
text-only Qwen2 never runs) and `sgl_kernel` (CUDA/AMX kernels; on CPUs without AMX SGLang uses its
native-torch fallbacks). This module registers import-time stand-ins for both in this process and in
every process SGLang spawns (they re-import this module as their `__main__`), then runs SGLang's own
launcher. A stand-in for `sgl_kernel` raises as soon as anything is *called* on it, so a run that
finishes proves no kernel was needed. It also swaps the `torch_native` attention backend for the batched
one in `backends/cpu_attention.py`, through SGLang's backend registry (`DAPO_CPU_ATTENTION=stock` keeps
SGLang's own, for comparisons). And it starts SGLang's scheduler and detokenizer by forking this process
instead of spawning fresh interpreters (`fork_workers`). Nothing is installed into or edited in
site-packages.

On GPU machines SGLang is imported and launched as usual; this module is for CPU only.
"""

from __future__ import annotations

import functools
import gc
import importlib.abc
import importlib.machinery
import logging
import multiprocessing
import os
import sys
import threading
import types
from typing import Any


class _AnyAttribute(type):
    # Enum-like members used at import time (`InterpolationMode.BICUBIC` in transformers' image code).
    def __getattr__(cls, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return name


class _Placeholder(metaclass=_AnyAttribute):
    """Stands for any class or enum a stand-in module is asked for at import time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> type:
        return cls


class _StandInModule(types.ModuleType):
    """A package whose every attribute is another stand-in: submodules for lowercase names,
    placeholder classes for capitalised ones. `strict` modules raise when called."""

    def __init__(self, name: str, *, strict: bool) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        # transformers parses the version of anything importable; torch 2.13 pairs with torchvision 0.28.
        self.__version__ = "0.28.0"
        self._strict = strict

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        if attr[:1].isupper():
            value: Any = type(attr, (_Placeholder,), {"__module__": self.__name__})
        else:
            value = sys.modules.get(full) or _StandInModule(full, strict=self._strict)
            sys.modules.setdefault(full, value)
        setattr(self, attr, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._strict:
            raise RuntimeError(
                f"{self.__name__} was called, but only a CPU stand-in is installed; this code "
                "path needs the real CUDA/AMX kernel package"
            )
        return args[0] if len(args) == 1 and callable(args[0]) else self  # decorators pass through


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: dict[str, bool]) -> None:
        self.packages = packages  # top-level name -> strict

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandInModule(spec.name, strict=self.packages[spec.name.split(".")[0]])

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_stand_ins() -> None:
    """Idempotent. Only for CPU processes: never call it where the real packages exist."""
    if not any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StandInFinder({"torchvision": False, "sgl_kernel": True}))
    # SGLang's CPU code paths are gated on this variable (is_cpu() returns False without it).
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    # megatron-core shares the environment only because the trainer needs it. SGLang's debug dumper imports
    # it whenever it is installed, to report Megatron's parallel state, which an engine never has: 0.6 s of
    # one core before the server can start. None in sys.modules makes that import fail as if it were absent.
    sys.modules.setdefault("megatron", None)


def defer_compilation() -> None:
    """SGLang decorates functions with `torch.compile` as its modules are imported, and each decoration
    imports torch's compiler (~0.6 s of the engine's start on one core) for functions that a CPU engine
    serving Qwen2 never calls (MoE and GPU kernels' helpers). From here on a function (or static method) is
    handed to `torch.compile` at its first call instead, with the same arguments, so what runs is what ran
    before; modules still compile at once. Idempotent."""
    import torch

    compile_now = torch.compile
    if getattr(compile_now, "deferred", False):
        return

    def compile_at_first_call(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as `@torch.compile(...)`
            return functools.partial(compile_at_first_call, **options)
        if isinstance(model, torch.nn.Module):  # callers use the module that comes back as a module
            return compile_now(model, **options)
        compiled: Any = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    compile_at_first_call.deferred = True  # type: ignore[attr-defined]
    torch.compile = compile_at_first_call  # type: ignore[assignment]


def install() -> None:
    """Stand-ins, deferred compilation, then the batched CPU attention (which imports SGLang, so it needs
    the stand-ins)."""
    install_stand_ins()
    defer_compilation()
    attention = os.environ.get("DAPO_CPU_ATTENTION", "batched")
    if attention not in ("batched", "stock"):
        raise ValueError(f"DAPO_CPU_ATTENTION must be batched or stock; got {attention!r}")
    if attention == "batched":
        from dapo_megatron.backends import cpu_attention

        cpu_attention.register()


install()  # at import, before anything imports SGLang


class _ForkStart:
    """`multiprocessing` as SGLang's launcher sees it: every process forks, and its request for `spawn` is
    declined."""

    def __init__(self) -> None:
        self._fork, self._spawn = multiprocessing.get_context("fork"), multiprocessing.get_context("spawn")

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        # A fork copies only the calling thread: with another one running, the child could inherit a lock it
        # held and wait on it forever. SGLang's launcher starts no thread before its workers; should a
        # version do so, they spawn as SGLang meant (slower, and safe).
        if name == "Process" and threading.active_count() > 1:
            logging.getLogger(__name__).warning(
                "a thread runs in the engine's launcher (%s): SGLang's workers spawn, which is slower",
                ", ".join(thread.name for thread in threading.enumerate()),
            )
            return self._spawn.Process
        return getattr(self._fork, name)


def fork_workers() -> None:
    """SGLang starts its scheduler and detokenizer with `spawn`: each is a fresh interpreter that imports
    torch, SGLang and this module again, ~7 s of an ~18 s server start on two cores, all before the first
    request. On a CPU nothing stands against `fork` (`spawn` is for CUDA, which cannot survive a fork): the
    children start from this process with all of that imported, and with the stand-ins and the attention
    backend already in place. The launcher has run no parallel torch op and started no thread by then, so a
    forked child inherits no thread pool or lock in use (with a thread running, `_ForkStart` spawns)."""
    from sglang.srt.entrypoints import engine

    engine.mp = _ForkStart()


def main(argv: list[str]) -> None:
    """What `python -m sglang.launch_server` does, after the stand-ins are in place."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    fork_workers()
    server_args = prepare_server_args(argv)
    # What the imports made stays for the server's life. Frozen, the forked scheduler's collections skip it:
    # its set-up runs a full `gc.collect()` before sizing the KV cache, which walked every object inherited
    # from the launcher (~0.4 s of one core, copying each page it touched).
    gc.freeze()
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
