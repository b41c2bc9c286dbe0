"""Runs inside a CPU SGLang engine: loads a weight update and keeps its shared-memory tensors mapped.

The trainer's CPU weight sync sends tensors that live in shared memory for the whole job (its parameters,
moved there once, and one reused staging buffer), by file name (torch's `file_system` sharing). The engine
rebuilds each storage from its name, and torch reuses an already mapped storage only while something still
holds it. Without a holder every sync mapped the model's size of /dev/shm afresh, one page fault per 4 KiB
(~140k for 580 MB): more time than the engine's copy into its own weights (measured). Holding the tensors of
the previous update makes the next one a cache hit; the trainer writes the same storages in place, so what
they show is always the weights being loaded. The mapped pages are the trainer's own: holding them costs no
memory.

The copy runs on every core the engine may use, not on its generation threads: SGLang generates nothing
during a weight update, and the trainer waits for it (the CPU sync sends one bucket at a time), so the cores
are idle otherwise, and a copy of the model's size is bound by how many cores read and write memory at once.

SGLang calls `load_keeping_mappings` for `update_weights_from_tensor` requests whose `load_format` is
`LOAD_FORMAT`; the engine must be launched with `--custom-weight-loader LOAD_FORMAT` (SGLang's plugin hook).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine launcher imports this module for LOAD_FORMAT before torch is needed
    import torch

LOAD_FORMAT = f"{__name__}.load_keeping_mappings"

_held: dict[str, torch.Tensor] = {}
"""Tensor name -> the shared-memory tensor of the latest update that carried it."""


def load_keeping_mappings(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        model.load_weights(named_tensors)  # type: ignore[operator]  # SGLang's models define it
    finally:
        torch.set_num_threads(threads)  # generation's count (backends/engine_threads.py) again
    _held.update(named_tensors)


def named_views(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flattened bucket (`rollout/weight_sync.flatten_bucket`), as views of its buffer: what
    `load_keeping_mappings` receives instead of SGLang's flattened format."""
    flat = payload["flattened_tensor"]
    return [
        (meta.name, flat[meta.start_idx : meta.end_idx].view(meta.dtype).view(meta.shape))
        for meta in payload["metadata"]
    ]
