"""Run megatron-core 0.16.1 on a CPU-only torch build.

megatron-core assumes CUDA in a handful of places (each module and function is listed below,
`_SCOPED_MODULES` and `_TENSOR_METHOD_SITES`): `device="cuda"` literals in the pipeline schedules,
optimizer and grad clipping; `torch.cuda.current_device()` as a device argument (RoPE, p2p,
grad buffers, checkpoint saver); `torch.cuda.synchronize()`; CUDA RNG states in the tensor-parallel
RNG tracker; `Tensor.cuda()` (also in the fully parallel checkpoint load's exchange); and string checks
such as `param.type() == "torch.cuda.FloatTensor"`.

`apply()` redirects exactly those, and does nothing when CUDA is available, so the GPU path runs
untouched. Nothing in site-packages is edited. Two mechanisms, chosen so the model's forward and
backward pay no overhead:

* Module-scoped `torch`: inside the listed megatron modules only, the global name `torch` is
  replaced by a proxy whose tensor factories map CUDA devices to the CPU and whose `torch.cuda`
  answers `current_device()`/`synchronize()`/RNG calls for the CPU. Every other module, ours
  included, sees the real torch.
* A `TorchFunctionMode` that rewrites `Tensor.cuda()` and `Tensor.type()`, entered only inside the
  megatron functions that call them (`_TENSOR_METHOD_SITES`: optimizer construction, grad clipping,
  tied-embedding setup), never around a forward pass: a global mode would intercept every tensor
  operation of every forward and backward pass, which makes a tiny model's step markedly slower.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch

# Modules whose `torch.*` calls carry CUDA devices or call torch.cuda (megatron-core 0.16.1).
_SCOPED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.data",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
)

# Modules on the forward/backward path whose only CUDA assumption is `torch.cuda.current_device()` as
# the device of new buffers (the all-gather and reduce-scatter of sequence parallelism): their proxy
# swaps `torch.cuda` and hands out torch's own functions, unwrapped.
_CUDA_NAMESPACE_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
)

# (module, qualified name) of functions that call Tensor.cuda() or compare Tensor.type() strings.
_TENSOR_METHOD_SITES = (
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.get_parameter_state_dp_zero"),
    ("megatron.core.dist_checkpointing.exchange_utils", "exchange_loaded_tensors_broadcast"),
    (
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule.setup_embeddings_and_output_layer",
    ),
)

_applied = False


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda(types.SimpleNamespace):
    """What megatron's `torch.cuda.*` calls need to mean on a CPU-only host."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _cpu_cuda() -> _CpuCuda:
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    return _CpuCuda(
        current_device=lambda: "cpu",
        synchronize=lambda *args, **kwargs: None,
        get_rng_state=get_rng_state,
        manual_seed=torch.manual_seed,
        random=types.SimpleNamespace(get_rng_state=get_rng_state),
    )


class _CpuTorch(types.ModuleType):
    """A stand-in for the `torch` module inside selected megatron modules only.

    `torch.cuda` answers for the CPU. With `map_devices`, functions also get their `device=` keyword
    mapped from CUDA to the CPU and `pin_memory` dropped (pinning needs CUDA); otherwise, and for
    classes, submodules and constants always, torch's own objects pass through.
    """

    def __init__(self, *, map_devices: bool) -> None:
        super().__init__("torch")
        self.cuda = _cpu_cuda()
        self._map_devices = map_devices

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if self._map_devices and isinstance(attr, types.BuiltinFunctionType | types.FunctionType):
            attr = _with_cpu_device(attr)
        setattr(self, name, attr)  # cache: __getattr__ only runs on a miss
        return attr


def _with_cpu_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _CpuTensorMethods(torch.overrides.TorchFunctionMode):
    """Makes `t.cuda()` a no-op and reports CPU tensors as `torch.cuda.*Tensor` to `t.type()`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        result = func(*args, **kwargs)
        if (
            func is torch.Tensor.type
            and len(args) == 1
            and not kwargs
            and not result.startswith("torch.cuda.")
        ):
            return result.replace("torch.", "torch.cuda.", 1)
        return result


def _in_cpu_tensor_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CpuTensorMethods():
            return fn(*args, **kwargs)

    return wrapper


def _set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    # megatron defers this through torch.cuda._lazy_call, which on a CPU build queues the call forever.
    torch.set_rng_state(new_state)


def active() -> bool:
    """Whether `apply()` redirected megatron-core in this process (never with CUDA)."""
    return _applied


def apply() -> None:
    """Redirect megatron-core's CUDA assumptions to the CPU. Idempotent; a no-op with CUDA."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    cpu_torch, cuda_namespace_only = _CpuTorch(map_devices=True), _CpuTorch(map_devices=False)
    for module_name in _SCOPED_MODULES:
        importlib.import_module(module_name).torch = cpu_torch
    for module_name in _CUDA_NAMESPACE_MODULES:
        importlib.import_module(module_name).torch = cuda_namespace_only

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = _set_cuda_rng_state

    for module_name, qualname in _TENSOR_METHOD_SITES:
        owner: Any = importlib.import_module(module_name)
        *parents, attr = qualname.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, attr, _in_cpu_tensor_mode(getattr(owner, attr)))
    _applied = True
