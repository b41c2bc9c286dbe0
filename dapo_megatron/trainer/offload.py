"""The trainer's device state in host memory while the engine generates (`trainer.offload_during_rollout`).

What moves: every device storage behind this rank's parameters, megatron DDP's contiguous gradient buffers
(and, with the distributed optimizer, its parameter buffer), and the optimizer's tensors: the fp32 main
parameters of 16-bit weights and Adam's exp_avg / exp_avg_sq. With the distributed optimizer those exist
only for this rank's shard, so each rank moves its shard only.

How: each storage is copied whole into a host buffer (pinned when CUDA is available, so the copies run at the
link's speed and asynchronously) and then resized to 0 bytes, which hands its memory back to the allocator;
`reload` resizes it again and copies the bytes back. The tensors themselves are untouched, so every view of
a storage (a parameter inside DDP's buffer, `param.main_grad`, the buckets' views, the optimizer's shard
views) and every reference to it (the optimizer's param groups and state, megatron's bucket groups) stays
valid across the round trip, which leaves every byte as it was. This is what slime and verl do
(megatron-core's own `_ParamAndGradBuffer.offload_to_cpu` does it for the DDP buffers, but drops the
gradients, and its optimizer offload replaces tensors, breaking the distributed optimizer's views).

Storages are found anew at each offload (Adam's state appears at the first step, a checkpoint load replaces
it) and de-duplicated, since views share them (DDP's buffers hold the parameters and their gradients; the
distributed optimizer's fp32 shards of fp32 parameters are views of the parameter buffer). Host buffers are
kept between offloads and reused by size: pinned allocations are slow.

On CPU the "device" is the host too: the round trip is the same code and the storages are really released
(their memory goes back to the allocator while the host buffer holds the bytes), so the mechanism is tested
there, but nothing is gained. Storages in shared memory stay where they are: on CPU the engine maps the
trainer's parameters there (`rollout/weight_sync.py`), so they are its weights too, and resizing a shared
storage would unmap pages under the engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dapo_megatron import backends


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    host: torch.Tensor
    """uint8 [storage.nbytes()]: the storage's bytes while it is released."""


class TrainerStateOffload:
    """Moves a megatron DDP model's device state and its (distributed) optimizer's state to host memory and
    back. `offload` and `reload` are local (no collective) and idempotent.

    Args:
        model: the DDP-wrapped model chunk (`megatron.core.distributed.DistributedDataParallel`).
        optimizer: its megatron optimizer (chained or not, distributed or not).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self._moved: list[_Moved] = []
        self._host_buffers: dict[int, list[torch.Tensor]] = {}
        """nbytes -> host buffers of that size, kept for the next offload."""
        self.device = next(model.parameters()).device
        self.backend = backends.of(self.device)

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory now (0 while the state is on the device)."""
        return sum(moved.host.numel() for moved in self._moved)

    def offload(self) -> float:
        """Copy every device storage of the state to host memory, then release it. Returns the seconds
        taken."""
        if self.offloaded:
            return 0.0
        started = time.perf_counter()
        spare = {size: list(buffers) for size, buffers in self._host_buffers.items()}
        for storage in self._storages():
            size = storage.nbytes()
            host = spare.get(size, []).pop() if spare.get(size) else self._new_host_buffer(size)
            host.copy_(_bytes_of(storage), non_blocking=True)
            self._moved.append(_Moved(storage, host))
        self._synchronize()  # the copies must be complete before their sources are freed
        for moved in self._moved:
            moved.storage.resize_(0)
        self.backend.empty_cache()  # the freed blocks back to the driver, where a GPU engine can map them
        return time.perf_counter() - started

    def reload(self) -> float:
        """Reallocate every released storage and copy its bytes back. Returns the seconds taken."""
        if not self.offloaded:
            return 0.0
        started = time.perf_counter()
        for moved in self._moved:
            moved.storage.resize_(moved.host.numel())
            _bytes_of(moved.storage).copy_(moved.host, non_blocking=True)
        self._synchronize()  # the host buffers are reused by the next offload
        self._moved = []
        return time.perf_counter() - started

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The state on the device for the duration (a checkpoint, an export), then back where it was."""
        was_offloaded = self.offloaded
        self.reload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()

    def _storages(self) -> list[torch.UntypedStorage]:
        """Each device storage of the state once, in a fixed order: the model's, then the optimizer's."""
        seen: set[int] = set()
        out = []
        for tensor in self._tensors():
            storage = tensor.untyped_storage()
            if (
                storage.device != self.device
                or storage.nbytes() == 0
                or storage.data_ptr() in seen
                or self.backend.engine_opens_in_place(_bytes_of(storage))
            ):
                continue
            seen.add(storage.data_ptr())
            out.append(storage)
        return out

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from self.model.parameters()
        for buffer in [*self.model.buffers, *self.model.expert_parallel_buffers]:  # megatron DDP's
            if buffer.param_data is not None:
                yield buffer.param_data
            yield buffer.grad_data
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:  # fp32 main parameters (or the fp32 model parameters)
                    yield param
                    if param.grad is not None:
                        yield param.grad
            for state in inner.state.values():
                yield from (value for value in state.values() if isinstance(value, torch.Tensor))

    def _new_host_buffer(self, size: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.backend.pin_host_memory())
        self._host_buffers.setdefault(size, []).append(buffer)
        return buffer

    def _synchronize(self) -> None:
        self.backend.synchronize(self.device)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """uint8 [storage.nbytes()]: a tensor over the whole storage, whatever dtypes its views have."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
