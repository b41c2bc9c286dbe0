"""Push the trainer's weights into SGLang engines after every optimizer step.

Megatron shards (any TP x PP, any DP) -> one full parameter at a time (TP all-gather) -> Hugging Face
tensors through `models.hf_mapping` (the same mapping the converters use) -> buckets of at most
`rollout.sync_bucket_mb` -> SGLang's `update_weights_from_tensor` with `load_format="flattened_bucket"`,
between `begin_weight_update` and `end_weight_update` (required from SGLang 0.5.21 on).

Each pipeline stage pushes its own layers (from its data-parallel rank 0, tensor-parallel rank 0), so
nothing is funnelled through one rank and at most one bucket beyond the model is alive per stage. A
bucket is a single uint8 buffer: CUDA memory on GPU (the engine opens it through a CUDA IPC handle), and
shared memory on CPU (torch's `file_system` sharing strategy: the engine is an unrelated process and cannot
receive file descriptors). The request returns after the engine has copied the weights, so the buffer is
freed right after.

SGLang answers `success: true` for tensor names it does not know and ignores them, so an HTTP status
proves nothing: `check_sync` compares the engine's log-probs with the trainer's on a probe batch.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import requests
import torch

from dapo_megatron.models import hf_mapping
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.weights import iter_full_tensors

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout


class WeightSyncError(RuntimeError):
    """The engine refused the weights, or holds different weights than the trainer after a sync."""


@dataclass
class SyncStats:
    version: str
    seconds: float
    bytes: int  # HF bytes this rank pushed; sum over ranks for the model size
    buckets: int


def iter_hf_tensors(model: torch.nn.Module, cfg: ModelConfig,
                    layout: ParallelLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for this pipeline stage's parameters. Collective over the TP group; every
    TP rank gets the tensors, the caller decides who sends them."""
    for name, tensor in iter_full_tensors(model, cfg, layout):
        yield from hf_mapping.megatron_to_hf(name, tensor, cfg)


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into lists of at most `max_bytes` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(bucket: Sequence[tuple[str, torch.Tensor]], staging: torch.Tensor | None = None) -> dict[str, Any]:
    """SGLang's flattened-bucket payload: one uint8 buffer plus per-tensor metadata.

    The tensors are copied once, into `staging` when it is given and large enough (a persistent shared-memory
    buffer on CPU), else into a new buffer (shared memory on CPU, device memory on GPU).
    """
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    total = sum(t.numel() * t.element_size() for _, t in bucket)
    if staging is not None and staging.numel() >= total:
        flat = staging[:total]
    else:
        flat = shared_buffer(total) if bucket[0][1].device.type == "cpu" else \
            torch.empty(total, dtype=torch.uint8, device=bucket[0][1].device)
    metadata, start = [], 0
    for name, tensor in bucket:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        flat[start:start + raw.numel()].copy_(raw)
        metadata.append(FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                                start_idx=start, end_idx=start + raw.numel(), numel=raw.numel()))
        start += raw.numel()
    return {"flattened_tensor": flat, "metadata": metadata}


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor allocated directly in shared memory (`share_memory_()` on a fresh tensor would allocate
    twice and copy: 0.5 s for 580 MB, measured, against 0.06 s for the copy into a buffer reused across syncs)."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


def serialize(payload: Any) -> str:
    """SGLang's wire format for tensors over HTTP: base64 of a multiprocessing (ForkingPickler) pickle,
    in which torch tensors travel as CUDA IPC handles or shared-memory file names."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class TensorWeightSync:
    """Pushes the policy into one or more SGLang engines (each receives every tensor)."""

    def __init__(self, engine_urls: Sequence[str], model_cfg: ModelConfig, layout: ParallelLayout, *,
                 bucket_bytes: int, engine_tp_size: int = 1, timeout_s: float = 600.0) -> None:
        self.urls = list(engine_urls)
        self.cfg, self.layout = model_cfg, layout
        self.bucket_bytes = bucket_bytes
        self.engine_tp_size = engine_tp_size
        self.timeout_s = timeout_s
        self._staging: torch.Tensor | None = None
        if layout.device.type == "cpu":
            # The default strategy passes file descriptors, which only processes sharing our multiprocessing
            # authkey can receive; SGLang's scheduler would fail to unpickle and crash (measured).
            torch.multiprocessing.set_sharing_strategy("file_system")

    @property
    def is_sender(self) -> bool:
        return self.layout.dp_rank == 0 and self.layout.tp_rank == 0

    def sync(self, model: torch.nn.Module, version: str) -> SyncStats:
        """Collective over all ranks: after it returns, every engine serves `model`'s weights as `version`."""
        started = time.perf_counter()
        if self.layout.rank == 0:
            self._post_all("/begin_weight_update", {})
        torch.distributed.barrier()
        sent_bytes = sent_buckets = 0
        error: str | None = None
        if self.layout.dp_rank == 0:  # other replicas hold the same weights
            for bucket in buckets(iter_hf_tensors(model, self.cfg, self.layout), self.bucket_bytes):
                if not self.is_sender or error is not None:
                    continue  # keep iterating: the TP all-gathers are collective
                try:
                    self._push(bucket, version)
                except WeightSyncError as failure:
                    error = str(failure)  # finish the collectives first, then fail on every rank together
                else:
                    sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    sent_buckets += 1
        failed = torch.tensor([error is not None], dtype=torch.int)
        torch.distributed.all_reduce(failed)
        if self.layout.rank == 0:
            self._post_all("/end_weight_update", {})
        if error is not None:
            raise WeightSyncError(error)
        if int(failed):
            raise WeightSyncError("another rank failed to push its weights to the engine (see its log)")
        return SyncStats(version=version, seconds=time.perf_counter() - started, bytes=sent_bytes,
                         buckets=sent_buckets)

    def _push(self, bucket: list[tuple[str, torch.Tensor]], version: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if self.layout.device.type == "cpu" and (self._staging is None or self._staging.numel() < nbytes):
            # One shared buffer for every bucket of every sync: the engine has copied a bucket out of it
            # before its request returns, and re-faulting fresh shared memory each time dominated the sync.
            self._staging = shared_buffer(max(nbytes, min(self.bucket_bytes, 2**30)))
        push_bucket(self.urls, bucket, version=version, engine_tp_size=self.engine_tp_size, timeout_s=self.timeout_s,
                    staging=self._staging)

    def _post_all(self, path: str, body: dict[str, Any]) -> None:
        post_all(self.urls, path, body, timeout_s=self.timeout_s)


def push_bucket(urls: Sequence[str], bucket: Sequence[tuple[str, torch.Tensor]], *, version: str,
                engine_tp_size: int, timeout_s: float, staging: torch.Tensor | None = None) -> None:
    """One `update_weights_from_tensor` call per engine (inside a begin/end weight-update session)."""
    payload = flatten_bucket(bucket, staging)
    # The engine slices its own TP shard from the full tensors: the same payload for every rank.
    serialized = [serialize(payload)] * engine_tp_size
    post_all(urls, "/update_weights_from_tensor", {
        "serialized_named_tensors": serialized, "load_format": "flattened_bucket", "flush_cache": True,
        "weight_version": version}, timeout_s=timeout_s)
    del payload  # the engines have copied it: a fresh buffer is released now, a staging buffer reused


def post_all(urls: Sequence[str], path: str, body: dict[str, Any], *, timeout_s: float) -> None:
    for url in urls:
        try:
            response = requests.post(url + path, json=body, timeout=timeout_s)
        except requests.RequestException as failure:
            raise WeightSyncError(f"POST {url}{path} failed: {failure}; is the engine alive?") from failure
        if response.status_code != 200:
            raise WeightSyncError(f"POST {url}{path} answered {response.status_code}: {response.text[:500]}")


def check_sync(trainer_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, mask: torch.Tensor, *,
               tolerance: float, version: str) -> float:
    """Largest |engine - trainer| log-prob over `mask`; raises WeightSyncError beyond `tolerance`.

    All tensors [n, L]. A weight SGLang silently ignored (a name it does not know) shows up here as a
    large difference, not as an HTTP error.
    """
    diff = ((engine_log_probs - trainer_log_probs).abs() * mask).max().item()
    if not diff <= tolerance:  # also catches NaN
        raise WeightSyncError(
            f"after syncing weight version {version!r} the engine's log-probs differ from the trainer's by "
            f"{diff:.3g} (tolerance {tolerance:g}): a weight was not loaded (unknown tensor name?), or the "
            "engine and trainer dtypes differ (raise rollout.sync_check_tolerance for bf16)")
    return diff
