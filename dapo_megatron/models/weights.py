"""Move whole (unsharded) Megatron tensors in and out of this rank's TP x PP shard of the model.

Names on the outside are canonical: megatron-core local-spec names with the global layer index
(`decoder.layers.17.mlp.linear_fc1.weight`), the vocabulary padded for the current TP size, whichever layer
spec built the model (Transformer Engine's fused-norm names are mapped in `local_params`). The
per-parameter layout rules (which dim is split, the fc1 gate/up interleave) live in `hf_mapping`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dapo_megatron.models import hf_export, hf_io, hf_mapping
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.models.safetensors_reader import SafetensorsReader

if TYPE_CHECKING:
    from dapo_megatron.distributed.layout import ParallelLayout


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    # DDP and Float16Module keep the GPTModel under `.module`; names must not carry the prefixes.
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def finish_param_gather(model: torch.nn.Module) -> None:
    """Collective over data parallel: make every parameter hold the optimizer's latest values.

    With `parallel.overlap_param_gather` the distributed optimizer updates only this rank's shard of each
    parameter and leaves the all-gather of the rest to the forward pre-hooks of the next forward pass, so
    between an optimizer step and that forward the parameters are 1/DP new and the rest one step old. Every
    reader of the weights outside a forward pass (the weight sync, a checkpoint, an HF export) calls this
    first. A no-op without the flag and when nothing is pending, so calling it twice costs nothing; it must
    be called by every rank of the data-parallel group together, as those readers are."""
    ddp_config = getattr(model, "ddp_config", None)
    if ddp_config is None or not (ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather):
        return
    for group in (*model.bucket_groups, *model.expert_parallel_bucket_groups):
        # Dispatches the bucket's all-gather if the step left it undispatched, then waits for it; without
        # dispatching the next bucket, whose turn comes here anyway.
        group.finish_param_sync(skip_next_bucket_dispatch=True)


def _layer_offset(cfg: ModelConfig, layout: ParallelLayout) -> int:
    return hf_mapping.layer_range(cfg, layout.pp_size, layout.pp_rank).start


def local_params(
    model: torch.nn.Module, cfg: ModelConfig, layout: ParallelLayout
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical global name, parameter) for every parameter this rank owns.

    With tied embeddings under pipeline parallelism the last stage holds a copy of the embedding as
    `output_layer.weight`; megatron-core keeps the two in sync, so only the first stage's is reported.
    """
    offset = _layer_offset(cfg, layout)
    for name, param in unwrap_model(model).named_parameters():
        if cfg.tie_word_embeddings and name == "output_layer.weight":
            continue
        # Transformer Engine layers own the norms (`linear_qkv.layer_norm_weight`); the canonical name is
        # the local spec's, which every mapping and every caller uses.
        canonical = hf_mapping.canonical_megatron_name(hf_mapping.local_to_global_name(name, offset))
        if canonical is not None:
            yield canonical, param


@torch.no_grad()
def load_full_state(
    model: torch.nn.Module, full_state: Mapping[str, torch.Tensor], cfg: ModelConfig, layout: ParallelLayout
) -> None:
    """Copy this rank's shard of each full tensor into the model. Every local parameter must be covered."""
    loaded = set()
    for name, param in local_params(model, cfg, layout):
        if name not in full_state:
            raise KeyError(f"full state has no tensor for {name}")
        _copy_shard(
            name,
            param,
            hf_mapping.shard_for_tensor_parallel(name, full_state[name], cfg, layout.tp_size, layout.tp_rank),
            layout,
        )
        loaded.add(name)
    unwrapped = unwrap_model(model)
    if cfg.tie_word_embeddings and layout.is_last_stage and not layout.is_first_stage:
        # The last stage's copy of a tied embedding is a separate tensor; give it the same values.
        name = "embedding.word_embeddings.weight"
        unwrapped.output_layer.weight.copy_(
            hf_mapping.shard_for_tensor_parallel(name, full_state[name], cfg, layout.tp_size, layout.tp_rank)
        )


def _copy_shard(name: str, param: torch.nn.Parameter, shard: torch.Tensor, layout: ParallelLayout) -> None:
    if shard.shape != param.shape:
        raise ValueError(
            f"{name}: shard shape {tuple(shard.shape)} does not match the model's "
            f"{tuple(param.shape)} (tp {layout.tp_rank}/{layout.tp_size})"
        )
    param.copy_(shard)


def iter_full_tensors(
    model: torch.nn.Module,
    cfg: ModelConfig,
    layout: ParallelLayout,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.data,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, full tensor) for the parameters of this pipeline stage.

    Collective over the TP group: every TP rank must iterate in the same order. One parameter is
    gathered at a time, so at most one full tensor is alive beyond the model itself. `tensor_of`
    picks what to gather (`lambda p: p.main_grad` gathers gradients).
    """
    for name, param in local_params(model, cfg, layout):
        local = tensor_of(param).detach()
        if layout.tp_size == 1 or hf_mapping.tensor_parallel_dim(name) is None:
            yield name, local
            continue
        shards = [torch.empty_like(local) for _ in range(layout.tp_size)]
        torch.distributed.all_gather(shards, local.contiguous(), group=layout.tp_group)
        yield name, hf_mapping.gather_tensor_parallel(name, shards)


def gather_full_state(
    model: torch.nn.Module,
    cfg: ModelConfig,
    layout: ParallelLayout,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.data,
) -> dict[str, torch.Tensor] | None:
    """The whole model's full tensors on global rank 0 (None elsewhere). For tools and tests:
    it holds everything in memory at once, which weight sync must not do."""
    finish_param_gather(model)
    stage = {name: tensor.cpu().clone() for name, tensor in iter_full_tensors(model, cfg, layout, tensor_of)}
    if layout.pp_size == 1:
        return stage if layout.rank == 0 else None
    # Only one replica per stage contributes (tp rank 0 of dp rank 0); the others send nothing.
    contribution = stage if layout.tp_rank == 0 and layout.dp_rank == 0 else {}
    gathered: list[dict[str, torch.Tensor]] | None = (
        [{} for _ in range(layout.world_size)] if layout.rank == 0 else None
    )
    torch.distributed.gather_object(contribution, gathered, dst=0)
    if gathered is None:
        return None
    return {name: tensor for part in gathered for name, tensor in part.items()}


def export_hf(
    model: torch.nn.Module,
    cfg: ModelConfig,
    layout: ParallelLayout,
    out_dir: Path | str,
    *,
    tokenizer_dir: Path | str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path | None:
    """Collective: write the model as a Hugging Face directory `out_dir` (returned on rank 0, None elsewhere).

    Streamed: the first replica of each pipeline stage (tp 0, dp 0) writes its stage's tensors, gathered over
    TP one at a time, as safetensors shards into a staging directory beside `out_dir` (on a filesystem every
    rank shares, as checkpoints need); rank 0 then writes the index and config.json and renames the directory
    into place, replacing an earlier export only once this one is complete. `tokenizer_dir` is the HF
    directory the model comes from: its tokenizer and other non-weight files are copied, and its config.json,
    if it has one, is kept whole (bos/eos_token_id and the rest) with the weights' dtype; without one
    config.json is `cfg.to_hf_config()`. If any rank fails, every rank raises and
    the staging directory is removed.
    """
    finish_param_gather(model)
    dtype = next(unwrap_model(model).parameters()).dtype
    staging: list[Path | None] = [hf_export.make_staging(out_dir) if layout.rank == 0 else None]
    torch.distributed.broadcast_object_list(staging, src=0)
    files: list[hf_export.ShardFile] = []
    failure = None
    if layout.dp_rank == 0:  # other replicas hold the same weights
        writer = None
        if layout.tp_rank == 0:
            progress = hf_export.Progress(
                *hf_export.stage_totals(cfg, dtype, layout.pp_size, layout.pp_rank),
                label=f"hf export (stage {layout.pp_rank})",
            )
            writer = hf_export.ShardWriter(
                staging[0], dtype, max_shard_bytes, progress=progress, prefix=f"stage{layout.pp_rank:05d}-"
            )
        for name, full in iter_full_tensors(model, cfg, layout):
            if writer is None or failure is not None:
                continue  # still gather: the other TP ranks are in the same collectives
            try:
                writer.add_megatron(name, full, cfg)
            except Exception as error:  # reported to rank 0, then raised on every rank
                failure = f"rank {layout.rank}: {error!r}"
        if writer is not None and failure is None:
            try:
                files = writer.finish()
            except Exception as error:
                failure = f"rank {layout.rank}: {error!r}"
    reports = [None] * layout.world_size if layout.rank == 0 else None
    torch.distributed.gather_object((files, failure), reports, dst=0)
    errors: list[list[str] | None] = [None]
    if layout.rank == 0:
        has_config = tokenizer_dir is not None and (Path(tokenizer_dir) / "config.json").exists()
        base = hf_io.read_hf_config(tokenizer_dir) if has_config else None
        errors = [
            hf_export.publish_stages(
                staging[0], out_dir, reports, hf_export.export_config(base, cfg, dtype), tokenizer_dir
            )
        ]
    torch.distributed.broadcast_object_list(errors, src=0)
    if errors[0]:
        raise RuntimeError(
            f"Hugging Face export to {out_dir} failed; nothing was published there:\n  "
            + "\n  ".join(errors[0])
        )
    return Path(out_dir) if layout.rank == 0 else None


@torch.no_grad()
def load_hf_weights(
    model: torch.nn.Module,
    hf_dir: Path | str,
    cfg: ModelConfig,
    layout: ParallelLayout,
    *,
    progress: Callable[[int, int, int], None] | None = None,
) -> int:
    """Collective over data parallel: initialise this rank's shard from a Hugging Face safetensors checkpoint;
    returns the bytes this rank read.

    Only the first data-parallel replica reads, and each rank of it only what it holds: its pipeline stage's
    layers and, of those, its tensor-parallel rows or columns (`hf_mapping.hf_slices_for_shard`), one
    parameter at a time, so the memory on top of the model is one parameter's slices. The other replicas
    receive each shard by a broadcast over data parallel: at 32B and DP 16, one read of the 65 GB from the
    shared filesystem instead of sixteen (~1 TB), and the interconnect is faster than the filesystem. Every
    rank checks the checkpoint's shapes (its headers) so that a mismatch stops every rank. Values are cast to
    the model's dtype. `progress(done, total, bytes_read)` is called after each parameter.
    """
    params = list(local_params(model, cfg, layout))
    if cfg.tie_word_embeddings and layout.is_last_stage and not layout.is_first_stage:
        # The last stage's copy of a tied embedding is a separate tensor; give it the same values.
        params.append(("embedding.word_embeddings.weight", unwrap_model(model).output_layer.weight))
    reads = layout.dp_rank == 0
    source = torch.distributed.get_global_rank(layout.dp_group, 0) if layout.dp_size > 1 else None
    with SafetensorsReader(hf_dir) as reader:
        hf_mapping.check_hf_shapes(reader.shapes(), cfg)
        for done, (name, param) in enumerate(params, start=1):
            if reads:
                parts = [
                    reader.read(part.name, part.dim, part.start, part.stop)
                    for part in hf_mapping.hf_slices_for_shard(name, cfg, layout.tp_size, layout.tp_rank)
                ]
                _copy_shard(
                    name, param, hf_mapping.shard_from_hf_slices(name, parts, cfg, layout.tp_size), layout
                )
                del parts
            if source is not None:
                torch.distributed.broadcast(param.data, src=source, group=layout.dp_group)
            if progress is not None:
                progress(done, len(params), reader.bytes_read)
        return reader.bytes_read
