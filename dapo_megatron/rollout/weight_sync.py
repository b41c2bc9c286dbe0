"""Push the trainer's weights into SGLang engines after every optimizer step.

Megatron shards (any TP x PP, any DP) -> one full parameter at a time (TP all-gather) -> Hugging Face
tensors through `models.hf_mapping` (the same mapping the converters use) -> buckets of at most
`rollout.sync_bucket_mb` -> the engine, between `begin_weight_update` and `end_weight_update` (required
from SGLang 0.5.21 on). Each bucket is a single uint8 buffer in SGLang's flattened-bucket layout (on CPU
the engine receives views of it, see `backends/cpu_weight_loader.py`).

Each pipeline stage pushes its own layers (from its data-parallel rank 0, tensor-parallel rank 0), so
nothing is funnelled through one rank and at most one bucket beyond the model is alive per stage.

Two transports (`rollout.sync_method`):
- `tensor`: `update_weights_from_tensor`. The bucket is CUDA memory on GPU (the engine opens it through a
  CUDA IPC handle) and shared memory on CPU (torch's `file_system` sharing strategy: the engine is an
  unrelated process and cannot receive file descriptors). The request returns after the engine has copied
  the weights, so the buffer is free again right after.
- `distributed`: `update_weights_from_distributed`. Each sending rank opens, once, a gloo process group with
  every rank of every engine (`UpdateGroup`, outside the trainer's own torch.distributed world) and
  broadcasts each bucket over it while the engine's request for that bucket is in flight.

SGLang answers `success: true` for tensor names it does not know and ignores them, so an HTTP status
proves nothing: `check_sync` compares the engine's log-probs with the trainer's on a probe batch.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

import requests
import torch

from dapo_megatron import backends
from dapo_megatron.backends.cpu_weight_loader import named_views
from dapo_megatron.models import hf_mapping
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.weights import finish_param_gather, iter_full_tensors
from dapo_megatron.rollout.engine import address_towards
from dapo_megatron.rollout.engine_auth import ENGINE_AUTH

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout


Payload = dict[str, Any] | list[tuple[str, torch.Tensor]]
"""What one push carries: a `flatten_bucket` dict, or named tensors the engine can open where they are."""


class WeightSyncError(RuntimeError):
    """The engine refused the weights, or holds different weights than the trainer after a sync."""


@dataclass
class SyncStats:
    version: str
    seconds: float
    bytes: int  # HF bytes this rank pushed; sum over ranks for the model size
    buckets: int


def iter_hf_tensors(
    model: torch.nn.Module, cfg: ModelConfig, layout: ParallelLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for this pipeline stage's parameters. Collective over the TP group; every
    TP rank gets the tensors, the caller decides who sends them."""
    for name, tensor in iter_full_tensors(model, cfg, layout):
        yield from hf_mapping.megatron_to_hf(name, tensor, cfg)


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
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


class BucketEntry(NamedTuple):
    """Where one tensor lies in a flattened bucket: the fields of SGLang's `FlattenedTensorMetadata`, which
    the trainer builds without importing SGLang (1.5 s of a CPU trainer's start-up, for a record type). Made
    into SGLang's own only where a flattened bucket goes to SGLang as such (`push_bucket`)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def bucket_nbytes(bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def flatten_bucket(
    bucket: Sequence[tuple[str, torch.Tensor]], staging: torch.Tensor | None = None
) -> dict[str, Any]:
    """SGLang's flattened-bucket payload: one uint8 buffer plus a `BucketEntry` per tensor.

    The tensors are copied once, into `staging` when it is given and large enough (a persistent shared-memory
    buffer on CPU), else into a new buffer the engine can open (`Backend.bucket_buffer`).
    """
    total = bucket_nbytes(bucket)
    if staging is not None and staging.numel() >= total:
        flat = staging[:total]
    else:
        device = bucket[0][1].device
        flat = backends.of(device).bucket_buffer(total, device)
    metadata, start = [], 0
    for name, tensor in bucket:
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        flat[start : start + raw.numel()].copy_(raw)
        metadata.append(
            BucketEntry(name, tensor.shape, tensor.dtype, start, start + raw.numel(), raw.numel())
        )
        start += raw.numel()
    return {"flattened_tensor": flat, "metadata": metadata}


def with_in_place(payload: dict[str, Any], in_place: list[tuple[str, torch.Tensor]]) -> Payload:
    """`payload`, and with it the tensors set aside so far to be read where they lie (emptying `in_place`):
    one request and one cache flush for both. With the usual bucket size every staged tensor fits one bucket,
    which is then flattened after every tensor was set aside, so a sync is one request."""
    if not in_place:
        return payload
    merged = [*named_views(payload), *in_place]
    in_place.clear()
    return merged


def serialize(payload: Any) -> str:
    """SGLang's wire format for tensors over HTTP: base64 of a multiprocessing (ForkingPickler) pickle,
    in which torch tensors travel as CUDA IPC handles or shared-memory file names."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass(frozen=True)
class StageRoute:
    """How one pipeline stage's buckets reach the engines.

    The stage's sender (its data-parallel rank 0, tensor-parallel rank 0) pushes into `direct` itself. Every
    other engine is pushed by the rank that launched it, from the same GPU (or, on CPU, from a node the
    sender's shared memory does not reach); those ranks receive each bucket from the sender over `group`.
    """

    stage: int
    sender: int
    direct: tuple[str, ...]
    relayed: dict[int, tuple[str, ...]]
    """Receiving rank -> the URLs it pushes."""
    group: torch.distributed.ProcessGroup | None
    """The sender plus the receiving ranks; None when nothing is relayed."""


class WeightSync:
    """Pushes the policy into one or more SGLang engines (each receives every tensor); subclasses choose how
    a bucket travels (`_deliver`) and whether engines the sender cannot reach get it through their own rank
    (`relays`).

    Args:
        engine_urls: every engine of the job.
        engine_owners: for each engine, the global rank that launched it (default: rank 0 for all).
    Construction is collective: the ranks exchange their nodes and build the relay groups.
    """

    relays = False
    """Whether engines are pushed by their own rank (True) or all by each stage's sender (False)."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        model_cfg: ModelConfig,
        layout: ParallelLayout,
        *,
        bucket_bytes: int,
        engine_tp_size: int = 1,
        timeout_s: float = 600.0,
        engine_owners: Sequence[int] | None = None,
    ) -> None:
        self.urls = list(engine_urls)
        self.cfg, self.layout = model_cfg, layout
        self.backend = backends.of(layout.device)
        self.bucket_bytes = bucket_bytes
        self.engine_tp_size = engine_tp_size
        self.timeout_s = timeout_s
        self._staging: torch.Tensor | None = None
        owners = list(engine_owners) if engine_owners is not None else [0] * len(self.urls)
        if len(owners) != len(self.urls):
            raise ValueError(f"{len(self.urls)} engine URLs but {len(owners)} owner ranks")
        self.routes = self._plan_routes(owners)
        self._open()

    def _open(self) -> None:
        """What the transport sets up once, at the end of construction (nothing by default)."""

    @property
    def is_sender(self) -> bool:
        return self.layout.dp_rank == 0 and self.layout.tp_rank == 0

    def _plan_routes(self, owners: list[int]) -> list[StageRoute]:
        layout = self.layout
        ranks: list[Any] = [None] * layout.world_size
        torch.distributed.all_gather_object(ranks, (layout.node, layout.pp_rank, self.is_sender))
        senders = {pp: rank for rank, (_, pp, sends) in enumerate(ranks) if sends}
        routes = []
        for stage in range(layout.pp_size):
            sender = senders[stage]
            direct, relayed = [], {}
            for url, owner in zip(self.urls, owners, strict=True):
                # Nothing of ours reaches another node (`Backend.engine_relays_weights`: on one).
                reachable = self.backend.engine_relays_weights and ranks[owner][0] == ranks[sender][0]
                if self.relays and owner != sender and not reachable:
                    relayed.setdefault(owner, []).append(url)
                else:
                    direct.append(url)
            # Every rank creates every group, in the same order, members or not (torch.distributed's rule).
            group = torch.distributed.new_group([sender, *sorted(relayed)]) if relayed else None
            routes.append(
                StageRoute(stage, sender, tuple(direct), {r: tuple(u) for r, u in relayed.items()}, group)
            )
        return routes

    def sync(self, model: torch.nn.Module, version: str) -> SyncStats:
        """Collective over all ranks: after it returns, every engine serves `model`'s weights as `version`."""
        started = time.perf_counter()
        finish_param_gather(model)  # else the engines get 1/DP of the update (parallel.overlap_param_gather)
        if self.layout.rank == 0:
            self._post_all("/begin_weight_update", {})
        torch.distributed.barrier()
        self._sent_bytes = self._sent_buckets = 0
        self._error: str | None = None
        # Stage after stage: a receiving rank may belong to another stage's gathers, and ascending order on
        # every rank keeps the two kinds of collectives from waiting on each other.
        for route in self.routes:
            self._sync_stage(model, route, version)
        failed = torch.tensor([self._error is not None], dtype=torch.int)
        torch.distributed.all_reduce(failed)
        if self.layout.rank == 0:
            self._post_all("/end_weight_update", {})
        if self._error is not None:
            raise WeightSyncError(self._error)
        if int(failed):
            raise WeightSyncError("another rank failed to push its weights to the engine (see its log)")
        return SyncStats(
            version=version,
            seconds=time.perf_counter() - started,
            bytes=self._sent_bytes,
            buckets=self._sent_buckets,
        )

    def _sync_stage(self, model: torch.nn.Module, route: StageRoute, version: str) -> None:
        rank = self.layout.rank
        gathers = self.layout.pp_rank == route.stage and self.layout.dp_rank == 0  # the TP all-gathers
        receives = rank in route.relayed
        if not gathers and not receives:
            return
        named = iter_hf_tensors(model, self.cfg, self.layout)
        in_place: list[tuple[str, torch.Tensor]] = []  # tensors the engines can read where they are
        if rank == route.sender and route.group is None:
            named = self._set_aside(named, in_place)
        # Other replicas hold the same weights; a receiver outside the stage loops until the end marker.
        stream = buckets(named, self.bucket_bytes) if gathers else itertools.repeat(None)
        for bucket in stream:
            if rank == route.sender:
                payload = flatten_bucket(bucket, self._staging_for(bucket_nbytes(bucket)))
                self._relay(route, payload)
                self._deliver_checked(route.direct, with_in_place(payload, in_place), version)
            elif receives:
                received = self._relay(route, None)
                if received is None:
                    break
                self._deliver_checked(route.relayed[rank], received, version)
        if in_place:
            self._deliver_checked(route.direct, in_place, version)
        if rank == route.sender or (receives and gathers):  # a receiver outside the stage read it in the loop
            self._relay(route, None)  # the end marker

    def _set_aside(
        self, named: Iterator[tuple[str, torch.Tensor]], into: list[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Move the tensors that need no copy into `into` and yield the rest (by default: none, all of
        them)."""
        return named

    def _relay(self, route: StageRoute, payload: dict[str, Any] | None) -> dict[str, Any] | None:
        """The sender's `payload` (None: the end marker) on every rank of `route.group`; a no-op without
        one."""
        if route.group is None:
            return payload
        header = [None if payload is None else (payload["metadata"], payload["flattened_tensor"].numel())]
        torch.distributed.broadcast_object_list(header, src=route.sender, group=route.group)
        if header[0] is None:
            return None
        metadata, nbytes = header[0]
        flat = payload["flattened_tensor"] if payload is not None else self._receive_buffer(nbytes)
        torch.distributed.broadcast(flat, src=route.sender, group=route.group)
        return {"flattened_tensor": flat, "metadata": metadata}

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        staging = self._staging_for(nbytes)
        if staging is not None:
            return staging[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.layout.device)

    def _deliver_checked(self, urls: Sequence[str], payload: Payload, version: str) -> None:
        """Deliver unless an earlier bucket failed; a failure is kept so the collectives still finish and
        every rank fails together."""
        if not urls or self._error is not None:
            return
        try:
            self._deliver(urls, payload, version)
        except WeightSyncError as failure:
            self._error = str(failure)
        else:
            self._sent_bytes += (
                payload["flattened_tensor"].numel() if isinstance(payload, dict) else bucket_nbytes(payload)
            )
            self._sent_buckets += 1

    def close(self) -> None:
        """Release what the transport holds between syncs (nothing by default). Idempotent."""

    def _staging_for(self, nbytes: int) -> torch.Tensor | None:
        """The buffer a bucket of `nbytes` is flattened into; None: a fresh one per bucket."""
        raise NotImplementedError

    def _deliver(self, urls: Sequence[str], payload: Payload, version: str) -> None:
        """Deliver one flattened bucket (or the set-aside tensors) to the engines at `urls`; raise
        WeightSyncError if one refuses it."""
        raise NotImplementedError

    def _host_staging(self, nbytes: int, allocate: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """One host buffer for every bucket of every sync, grown when a bucket does not fit. Each push has
        finished with it before returning, and allocating (for shared memory: re-faulting) a fresh buffer
        per bucket would cost more than the copy into it. Sized by the buckets themselves, not by
        `bucket_bytes`: shared memory is committed when allocated (~0.2 s per GiB), and a small model's
        one bucket would otherwise hold /dev/shm's `rollout.sync_bucket_mb` (512 MB by default, more than
        a container's /dev/shm often has). A sync's buckets come in the same order every time, so it
        grows during the first sync only."""
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # drop the old one before allocating its successor
            self._staging = allocate(nbytes)
        return self._staging

    def _post_all(self, path: str, body: dict[str, Any]) -> None:
        post_all(self.urls, path, body, timeout_s=self.timeout_s)


class TensorWeightSync(WeightSync):
    """`update_weights_from_tensor`: the engine maps each bucket (shared memory on CPU, CUDA IPC on GPU)."""

    relays = True

    def sync(self, model: torch.nn.Module, version: str) -> SyncStats:
        self.backend.share_with_engines(list(model.parameters()))
        return super().sync(model, version)

    def _set_aside(
        self, named: Iterator[tuple[str, torch.Tensor]], into: list[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            if self.backend.engine_opens_in_place(tensor):
                into.append((name, tensor))
            else:
                yield name, tensor

    def _staging_for(self, nbytes: int) -> torch.Tensor | None:
        if not self.backend.reuses_bucket_buffer:
            return None
        return self._host_staging(nbytes, lambda size: self.backend.bucket_buffer(size, self.layout.device))

    def _deliver(self, urls: Sequence[str], payload: Payload, version: str) -> None:
        payload, load_format = self.backend.engine_payload(payload)
        push_bucket(
            urls,
            payload,
            version=version,
            engine_tp_size=self.engine_tp_size,
            timeout_s=self.timeout_s,
            load_format=load_format,
        )


class DistributedWeightSync(WeightSync):
    """`update_weights_from_distributed`: each sending rank (one per pipeline stage) broadcasts its buckets to
    every engine over its own `UpdateGroup`, opened here once and closed by `close()`."""

    def _open(self) -> None:
        # SGLang broadcasts from group rank 0 only, so a group has exactly one trainer rank: one group per
        # stage, named apart because the engine holds them all at once.
        self.group: UpdateGroup | None = (
            UpdateGroup(
                self.urls,
                name=f"dapo-weight-sync-pp{self.layout.pp_rank}",
                engine_tp_size=self.engine_tp_size,
                timeout_s=self.timeout_s,
            )
            if self.is_sender
            else None
        )

    def _staging_for(self, nbytes: int) -> torch.Tensor | None:
        # Private host memory: the bucket leaves through a socket, and /dev/shm is often small in containers.
        return self._host_staging(nbytes, lambda size: torch.empty(size, dtype=torch.uint8))

    def _deliver(self, urls: Sequence[str], payload: Payload, version: str) -> None:
        assert self.group is not None and isinstance(payload, dict), (
            "only sending ranks push, flattened buckets"
        )
        self.group.push(payload, version=version)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


SYNC_METHODS: dict[str, type[WeightSync]] = {"tensor": TensorWeightSync, "distributed": DistributedWeightSync}
"""`rollout.sync_method` -> the class that implements it."""


class UpdateGroup:
    """A gloo process group made of this trainer process (group rank 0, the only sender) and every rank of
    the given engines (engine i's TP rank r is 1 + i * engine_tp_size + r), for SGLang's
    `update_weights_from_distributed`. Opening it is collective with the engines; close it once.

    The group lives outside the trainer's own torch.distributed world: its own TCP store, served from this
    process, and a gloo group built by SGLang's `init_custom_process_group`, the helper the engine uses for
    its end, so both ends set gloo up with the same code. The engine reaches the store through
    `rendezvous("tcp://host:port")` and prefixes it with the group name
    (sglang/srt/utils/common.py:2899-2905); we serve the store ourselves and apply the same prefix, because
    our own `rendezvous` would, under torchrun (TORCHELASTIC_USE_AGENT_STORE), only dial a store it expects
    the elastic agent to serve, and wait forever. Gloo, not NCCL, also on GPU: a colocated engine shares the
    sender's GPU, and NCCL refuses two ranks of one communicator on one device.
    """

    def __init__(
        self, engine_urls: Sequence[str], *, name: str, engine_tp_size: int, timeout_s: float
    ) -> None:
        from sglang.srt.utils.common import init_custom_process_group

        self.urls, self.name, self.timeout_s = list(engine_urls), name, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="weight-sync")
        timeout = datetime.timedelta(seconds=timeout_s)
        host = address_towards(urlsplit(self.urls[0]).hostname or "127.0.0.1")
        world_size = 1 + len(self.urls) * engine_tp_size
        # Port 0: the OS picks a free one. Not waiting for the engines here: gloo's connection set-up below
        # does.
        store = torch.distributed.TCPStore(
            host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        # Each engine's request returns once its ranks have joined, which needs our end of the group.
        answers = [
            self._pool.submit(
                post_all,
                [url],
                "/init_weights_update_group",
                {
                    "master_address": host,
                    "master_port": store.port,
                    "rank_offset": 1 + i * engine_tp_size,
                    "world_size": world_size,
                    "group_name": name,
                    "backend": "gloo",
                },
                timeout_s=timeout_s,
            )
            for i, url in enumerate(self.urls)
        ]
        try:
            self.group: torch.distributed.ProcessGroup | None = init_custom_process_group(
                backend="gloo",
                store=torch.distributed.PrefixStore(name, store),
                world_size=world_size,
                rank=0,
                group_name=name,
                timeout=timeout,
            )
        except Exception as failure:
            refusals = [str(a.exception()) for a in answers if a.done() and a.exception() is not None]
            raise WeightSyncError(
                f"could not open the weight-update group {name!r} with {self.urls}: {failure}; "
                f"engine answers: {refusals or 'none yet'}"
            ) from failure
        _results(answers)

    def push(self, payload: dict[str, Any], *, version: str) -> None:
        """One `update_weights_from_distributed` request per engine (inside a begin/end weight-update session)
        for a `flatten_bucket` payload, answered after the engine has received it from our broadcast and
        loaded it."""
        if self.group is None:
            raise WeightSyncError(
                f"the weight-update group {self.name!r} is closed, or broken by an earlier failure"
            )
        metadata = payload["metadata"]
        body = {
            "names": [m.name for m in metadata],
            "dtypes": [str(m.dtype).removeprefix("torch.") for m in metadata],
            "shapes": [list(m.shape) for m in metadata],
            "group_name": self.name,
            "load_format": "flattened_bucket",
            "flush_cache": True,
            "weight_version": version,
        }
        answers = [
            self._pool.submit(
                post_all, [url], "/update_weights_from_distributed", body, timeout_s=self.timeout_s
            )
            for url in self.urls
        ]
        sent = torch.distributed.broadcast(
            payload["flattened_tensor"], group=self.group, group_src=0, async_op=True
        )
        # An engine that refuses the request (no session, a dtype it cannot build) never joins the broadcast:
        # its answer is the only news, so wait on the answers and fail on the first refusal.
        try:
            _results(answers)
        except WeightSyncError:
            # Our send may still be pending and would be matched with the engine's next receive: the group's
            # collectives are out of step for good, so it is not used again.
            self.group = None
            raise
        sent.wait()

    def close(self) -> None:
        """Tear down both ends. Best effort on the engine's: at shutdown it may already be gone, and its end
        of the group dies with it."""
        group, self.group = self.group, None
        self._pool.shutdown()
        if group is None:
            return
        with contextlib.suppress(WeightSyncError):
            post_all(
                self.urls,
                "/destroy_weights_update_group",
                {"group_name": self.name},
                timeout_s=min(self.timeout_s, 30.0),
            )
        torch.distributed.destroy_process_group(group)


def _results(answers: Sequence[Future[None]]) -> None:
    """Wait for every future; raise the first failure as soon as it happens."""
    done, _ = wait(answers, return_when=FIRST_EXCEPTION)  # all of them, unless one failed
    for answer in done:
        answer.result()


def push_bucket(
    urls: Sequence[str],
    payload: Payload,
    *,
    version: str,
    engine_tp_size: int,
    timeout_s: float,
    load_format: str | None = None,
) -> None:
    """One `update_weights_from_tensor` call per engine (inside a begin/end weight-update session) for a
    `flatten_bucket` payload or a list of named shared-memory / CUDA tensors; when it returns the engines
    have copied it and the buffer is free again. `load_format` names the engine's loader for a list (None:
    the model's `load_weights`); a flattened payload always uses SGLang's own."""
    if isinstance(payload, dict):  # SGLang's flattened-bucket loader reads its own metadata type
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        metadata = [FlattenedTensorMetadata(*entry) for entry in payload["metadata"]]
        payload = {**payload, "metadata": metadata}
    for url in urls:
        # The engine slices its own TP shard from the full tensors: the same payload for every rank, but
        # pickled once per receiving process. Pickling a shared-memory tensor takes one reference that the
        # receiver gives back; one pickle read by two processes gives back two, and the second unlinks the
        # buffer under us, and the next sync cannot open it.
        serialized = [serialize(payload) for _ in range(engine_tp_size)]
        post_all(
            [url],
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized,
                "load_format": "flattened_bucket" if isinstance(payload, dict) else load_format,
                "flush_cache": True,
                "weight_version": version,
            },
            timeout_s=timeout_s,
        )


def post_all(urls: Sequence[str], path: str, body: dict[str, Any], *, timeout_s: float) -> None:
    """POST to each engine in turn, with its API key (`rollout/engine_auth.py`); raises WeightSyncError."""
    for url in urls:
        try:
            response = requests.post(url + path, json=body, timeout=timeout_s, auth=ENGINE_AUTH)
        except requests.RequestException as failure:
            raise WeightSyncError(f"POST {url}{path} failed: {failure}; is the engine alive?") from failure
        if response.status_code != 200:
            raise WeightSyncError(f"POST {url}{path} answered {response.status_code}: {response.text[:500]}")


def check_sync(
    trainer_log_probs: torch.Tensor,
    engine_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    tolerance: float,
    version: str,
    engine: str = "the engine",
) -> float:
    """Largest |engine - trainer| log-prob over `mask`; raises WeightSyncError beyond `tolerance`.

    All tensors [n, L]. A weight SGLang silently ignored (a name it does not know) shows up here as a
    large difference, not as an HTTP error.
    """
    diff = ((engine_log_probs - trainer_log_probs).abs() * mask).max().item()
    if not diff <= tolerance:  # also catches NaN
        raise WeightSyncError(
            f"after syncing weight version {version!r}, {engine}'s log-probs differ from the trainer's by "
            f"{diff:.3g} (tolerance {tolerance:g}): a weight was not loaded (unknown tensor name?), or the "
            "engine and trainer dtypes differ (raise rollout.sync_check_tolerance for bf16)"
        )
    return diff
