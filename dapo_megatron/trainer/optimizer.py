"""megatron-core's optimizer (AdamW, optional ZeRO-1 distributed optimizer), learning-rate schedule, and their
state in a checkpoint (`sharded_optimizer_state`, `load_optimizer_state`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.trainer.config import OptimConfig


def build_optimizer(
    model: torch.nn.Module,
    optim: OptimConfig,
    parallel: ParallelConfig,
    model_cfg: ModelConfig,
    optimizer_steps_per_rollout_step: int | None = None,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """AdamW over a megatron DDP-wrapped model chunk, and a linear-warm-up-then-constant schedule.

    `optimizer_steps_per_rollout_step` (`TrainerConfig.optimizer_steps`) converts
    optim.lr_warmup_rollout_steps into the schedule's unit; it may be left out only without a warm-up. Call
    `scheduler.step(1)` before each `optimizer.step()`: optimizer step k (1-based) then runs at
    lr * min(1, k / warm-up optimizer steps), so even the first step learns (verl's schedule gives it lr 0).
    On resume the checkpoint restores the step count only; lr, warm-up and weight decay come from this config,
    so a corrected recipe applies to a resumed run too.
    """
    warmup = warmup_optimizer_steps(optim, optimizer_steps_per_rollout_step)
    config = OptimizerConfig(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=model_cfg.params_dtype == "bfloat16",
        fp16=model_cfg.params_dtype == "float16",
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    # megatron-core's default overrides (None) give biases and 1-D parameters wd_mult 0; no overrides decay
    # all.
    optimizer = get_megatron_optimizer(
        config, [model], config_overrides={} if optim.decay_all_parameters else None
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=warmup + 1,
        lr_decay_style="constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
    return optimizer, scheduler


def warmup_optimizer_steps(optim: OptimConfig, optimizer_steps_per_rollout_step: int | None) -> int:
    """optim.lr_warmup_rollout_steps in optimizer steps, the unit the schedule advances in."""
    if not optim.lr_warmup_rollout_steps:
        return 0
    if optimizer_steps_per_rollout_step is None or optimizer_steps_per_rollout_step < 1:
        raise ValueError(
            f"optim.lr_warmup_rollout_steps={optim.lr_warmup_rollout_steps} needs the optimizer steps "
            "per rollout step (trainer.optimizer_steps) to size the warm-up; got "
            f"{optimizer_steps_per_rollout_step}"
        )
    return optim.lr_warmup_rollout_steps * optimizer_steps_per_rollout_step


def sharded_optimizer_state(
    optimizer: MegatronOptimizer, model_state: dict[str, Any], *, is_loading: bool = False
) -> dict[str, Any]:
    """The optimizer's state as a `dist_checkpointing` sharded state dict, keyed by the global tensors of
    `model_state` (the unwrapped model's `sharded_state_dict()`), so it saves and loads under any
    TP x PP x DP layout. `is_loading`: a template to load into (allocates state a fresh optimizer lacks).

    The distributed optimizer's state is described where it lies (`_distributed_sharded_state`): each rank
    saves and loads only its own shard, with no gather and no host copy beyond what the writer stages."""
    if is_loading:
        _allocate_distributed_state(optimizer)
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    distributed = _distributed_parts(optimizer)
    if distributed:
        if len(distributed) != len(parts):
            raise NotImplementedError(
                "checkpointing a chain of distributed and non-distributed optimizers is not supported"
            )
        states = [_distributed_sharded_state(part, model_state, is_loading) for part in parts]
        return states[0] if len(states) == 1 else dict(enumerate(states))
    if len(parts) == 1 and isinstance(parts[0], Float16OptimizerWithFloat16Params):
        return _mixed_precision_sharded_state(parts[0], model_state, is_loading)
    return optimizer.sharded_state_dict(model_state, is_loading, metadata=dict(_SHARDED_METADATA))


MODEL_SPACE_SHARDS = "dapo_model_space_shards"
"""The distributed optimizer's sharding type in this project's checkpoints (`_distributed_sharded_state`)."""
FULLY_RESHARDABLE = "fully_reshardable"
"""megatron-core's type that earlier checkpoints of this project used: the same global tensors, so it loads
through the same code."""
PARAM_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The fp32 main parameter and Adam's moments, under megatron-core's names (`fully_reshardable`'s keys)."""


def _distributed_sharded_state(part: Any, model_state: dict[str, Any], is_loading: bool) -> dict[str, Any]:
    """One DistributedOptimizer's state: its non-tensor state as is, and every (main parameter, moment)
    element under `optimizer.state.<key>.<the model tensor's key>`, by the model tensor's global shape.

    Why not megatron-core 0.16.1's own types: `fully_reshardable` gathers the whole DP group's state of a
    TP x PP slice onto every rank (12 bytes per parameter of the slice in host memory, ~49 GB per rank at
    32B) and has every rank read all of it back; `dp_reshardable` stores megatron's bucket layout, which a
    TP or PP change cannot load; `fully_sharded_model_space` needs flattened ShardedTensors, which 0.16.1
    refuses. A rank's shard of one parameter is a contiguous range of its flattened elements, which is a
    union of at most a few rectangular boxes of the parameter (`flat_range_boxes`); each box is a view of the
    optimizer's own tensor and a chunk of the global tensor, the irregular chunks that torch_dist stores
    (`dp_reshardable` stores such chunks too). The global tensors are those `fully_reshardable` wrote, so its
    checkpoints load with this template, and any TP x PP x DP layout reads them back."""
    if is_loading:
        # megatron's own template step: allocates the state tensors a fresh optimizer lacks.
        part.load_state_dict(part.state_dict())
    state = part.state_dict()
    entries, _ = extract_sharded_tensors_and_factories(model_state)
    entry_of = {id(entry.data): entry for entry in _nested_values(entries)}
    tensors_of = _state_tensors(part)
    param_state: dict[int, list[dict[str, Any]]] = {}
    for index, (model_param, owned) in enumerate(_owned_ranges(part)):
        if id(model_param) not in entry_of:
            raise ValueError(f"a parameter of shape {tuple(model_param.shape)} is not in the model's state")
        tensors = tensors_of[id(model_param)]
        boxes = []
        for offset, piece in _pieces(entry_of[id(model_param)]):
            for start, sharded in _piece_boxes(piece, offset, owned, tensors, part):
                boxes.append({"start": LocalNonpersistentObject(start), **sharded})
        param_state[index] = boxes
    state["param_state"] = param_state
    state["param_state_sharding_type"] = MODEL_SPACE_SHARDS
    return state


def _owned_ranges(part: Any) -> list[tuple[Any, range]]:
    """(model parameter, the range of its flattened elements this DP rank's optimizer owns), in the
    distributed optimizer's own order of its buffers, buckets and parameters."""
    return [
        (model_param, range(ranges["param"].start, ranges["param"].end))
        for buffer_ranges in part.gbuf_ranges
        for bucket_ranges in buffer_ranges.values()
        for bucket in bucket_ranges
        for model_param, ranges in bucket["param_map"].items()
    ]


def _state_tensors(part: Any) -> dict[int, dict[str, Any]]:
    """id(model parameter) -> this rank's shard of its fp32 main parameter and Adam moments (1-D tensors the
    optimizer updates in place), under PARAM_STATE_KEYS.

    Not megatron-core 0.16.1's `_get_main_param_and_optimizer_states`: it indexes a parameter group's main
    parameters in model order, but the inner optimizer lists the group's fp32 parameters first, so it returns
    another parameter's state as soon as a group holds both fp32 and 16-bit parameters (the local layers'
    fp32 norms beside bf16 weights)."""
    out = {}
    for float16, masters, float32, shards in zip(
        part.model_float16_groups,
        part.shard_fp32_from_float16_groups,
        part.model_fp32_groups,
        part.shard_fp32_groups,
        strict=True,
    ):
        for model_param, main in [*zip(float16, masters, strict=True), *zip(float32, shards, strict=True)]:
            moments = part.optimizer.state[main]
            out[id(model_param)] = {
                "param": main,
                "exp_avg": moments["exp_avg"],
                "exp_avg_sq": moments["exp_avg_sq"],
            }
    return out


def _nested_values(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _nested_values(value)]
    if isinstance(tree, list | tuple):
        return [leaf for value in tree for leaf in _nested_values(value)]
    return [tree]


def _pieces(entry: Any) -> list[tuple[int, Any]]:
    """(offset in the flattened local tensor, ShardedTensor) of each part of the model tensor `entry` that
    its checkpoint stores apart: the tensor itself, or what a ShardedTensorFactory splits it into (SwiGLU's
    FC1 weight: its gate and up halves, each under its own global offset). The factory runs on a meta tensor
    of the local shape: only the offsets and shapes it produces are used."""
    if not isinstance(entry, ShardedTensorFactory):
        return [(0, entry)]
    meta = torch.empty(entry.data.shape, dtype=entry.data.dtype, device="meta")
    pieces = _nested_values(entry.build_fn(entry.key, meta, entry.replica_id, None))
    for piece in pieces:
        if not piece.data.is_contiguous():
            raise NotImplementedError(f"{entry.key}: a checkpoint factory that splits it non-contiguously")
    return [(piece.data.storage_offset(), piece) for piece in pieces]


def _piece_boxes(
    piece: Any, offset: int, owned: range, tensors: dict[str, Any], part: Any
) -> list[tuple[int, dict[str, Any]]]:
    """(start in the owned shard, {state key: ShardedTensor}) for each box of the model tensor part `piece`
    (flattened local elements [offset, offset + its size)) that falls in the `owned` range."""
    size = math.prod(piece.local_shape)
    first, last = max(owned.start, offset), min(owned.stop, offset + size)
    prepend = piece.prepend_axis_num
    # The DP coordinate of the model tensor's replica id is dropped: each DP rank stores its own elements.
    replica_id = (*piece.replica_id[:2], part.distributed_optimizer_instance_id)
    out = []
    for corner, shape in flat_range_boxes(piece.local_shape, first - offset, last - offset):
        start = offset + flat_index(corner, piece.local_shape) - owned.start
        numel = math.prod(shape)
        global_offset = (
            *piece.global_offset[:prepend],
            *(g + c for g, c in zip(piece.global_offset[prepend:], corner, strict=True)),
        )
        # The axes megatron prepends (a layer's index in the stacked layers) become leading axes of size 1:
        # torch_dist writes an irregular chunk by its local shape, which must then span every axis.
        local_shape = (1,) * prepend + tuple(shape)
        sharded = {}
        for key in PARAM_STATE_KEYS:
            data = tensors[key].detach().view(-1)[start : start + numel].view(local_shape)
            sharded[key] = ShardedTensor(
                f"optimizer.state.{key}.{piece.key}",
                data,
                data.dtype,
                local_shape,
                tuple(piece.global_shape),
                global_offset,
                None,  # an irregular chunk: no regular grid of equal shards
                replica_id,
                allow_shape_mismatch=piece.allow_shape_mismatch,
            )
        out.append((start, sharded))
    return out


def flat_range_boxes(
    shape: Sequence[int], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements [start, end) of a row-major tensor of `shape`, flattened, as rectangular boxes
    (corner, box shape), in order: a partial first row, whole rows, a partial last row, recursively
    along the axes. Each box is a contiguous range of the flattened tensor. E.g. shape (3, 4), elements
    [2, 10): ((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 2))."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (end - 1) // inner

    def in_row(row: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *c), (1, *s)) for c, s in flat_range_boxes(shape[1:], lo, hi)]

    if first_row == last_row:
        return in_row(first_row, start - first_row * inner, end - first_row * inner)
    boxes, whole_from, whole_to = [], first_row, last_row + 1
    if start % inner:
        boxes += in_row(first_row, start % inner, inner)
        whole_from += 1
    if end % inner:
        whole_to -= 1
    if whole_to > whole_from:
        boxes.append(((whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
    if end % inner:
        boxes += in_row(last_row, 0, end % inner)
    return boxes


def flat_index(corner: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major position of the element at `corner` in a tensor of `shape`."""
    index = 0
    for coordinate, size in zip(corner, shape, strict=True):
        index = index * size + coordinate
    return index


def _mixed_precision_sharded_state(
    part: Any, model_state: dict[str, Any], is_loading: bool
) -> dict[str, Any]:
    """Float16OptimizerWithFloat16Params.sharded_state_dict, with the same keys, for models that also hold
    fp32 parameters (the local layers' norms): megatron-core 0.16.1 numbers the optimizer's parameters as
    if all were bf16/fp16 and fails on the first fp32 one."""
    if is_loading:
        part.init_state_fn(part.optimizer, part.config)
    state = part.state_dict()
    # The inner optimizer holds, in the model's order, an fp32 master for each bf16/fp16 parameter and
    # each fp32 parameter itself; torch numbers them in that order.
    model_param_of = {
        id(master): param
        for params, masters in zip(part.float16_groups, part.fp32_from_float16_groups, strict=True)
        for param, master in zip(params, masters, strict=True)
    }
    inner = [param for group in part.optimizer.param_groups for param in group["params"]]
    by_id = get_param_id_to_sharded_param_map(model_state, [model_param_of.get(id(p), p) for p in inner])
    index = {id(param): i for i, param in enumerate(inner)}
    state["fp32_from_fp16_params"] = [
        [
            make_sharded_optimizer_tensor(
                by_id[index[id(master)]], master, prefix="optimizer.state.fp32_param"
            )
            for master in masters
        ]
        for masters in part.fp32_from_float16_groups
    ]
    step = part._extract_common_per_param_step(state["optimizer"])
    optim_state_to_sharding_state(state["optimizer"], by_id, exclude_keys="step")
    if step:
        state["optimizer"]["state"]["common_step"] = step
    return state


# Non-distributed optimizers: megatron-core's own sharded state, keyed by the model's tensors (their state is
# replicated over DP; the fully parallel save spreads its writes over the DP ranks). The sharding type only
# matters to a ChainedOptimizer: without a prefix its parts' keys are the model's.
_SHARDED_METADATA = {"distrib_optim_sharding_type": FULLY_RESHARDABLE, "chained_optim_avoid_prefix": True}


def load_optimizer_state(optimizer: MegatronOptimizer, state: Any) -> None:
    """`optimizer.load_state_dict(state)` (the loaded `sharded_optimizer_state`), refusing with the config
    field to set when the checkpoint's optimizer split the parameters differently into decayed and exempt
    ones (optim.decay_all_parameters)."""
    saved, current = _exempts_some(state), _exempts_some({"param_groups": optimizer.param_groups})
    if saved != current:
        raise ValueError(
            f"the checkpoint's optimizer {'exempts' if saved else 'decays'} biases and norm weights "
            f"from weight decay, this run's {'exempts' if current else 'decays'} them: resume with "
            f"optim.decay_all_parameters={str(not saved).lower()}"
        )
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    # The distributed parts' tensors are copied here, after their non-tensor state: megatron-core would
    # dispatch on the sharding type, which it does not know.
    deferred = [
        (part, part_state.pop("param_state"), part_state.pop("param_state_sharding_type"))
        for part, part_state in zip(parts, _part_states(state, len(parts)), strict=True)
        if part in _distributed_parts(optimizer) and "param_state" in part_state
    ]
    with torch.no_grad():  # the fp32 masters are leaves that require grad; they are written in place
        optimizer.load_state_dict(state)
        for part, param_state, sharding_type in deferred:
            if sharding_type not in (MODEL_SPACE_SHARDS, FULLY_RESHARDABLE):
                raise ValueError(
                    f"the checkpoint's distributed optimizer state is of sharding type {sharding_type!r}, "
                    f"which this version does not read: resume it with the version that wrote it"
                )
            _copy_param_state(part, param_state)
    # With torch's AdamW (no Apex/TE, e.g. on CPU) megatron-core 0.16.1's distributed optimizer hands every
    # parameter the same `step` tensor, which AdamW then increments once per parameter: the bias correction
    # would count parameters instead of steps. Each parameter gets its own counter.
    for part in parts:
        for param_state in part.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()


def _copy_param_state(part: Any, param_state: dict[int, list[dict[str, Any]]]) -> None:
    """Put each loaded box of `_distributed_sharded_state` at its place in the optimizer's tensors. torch_dist
    mostly loads into the template's views already; a box another rank read and sent arrives in a new
    tensor, and `load_state_dict` above may have replaced the state tensors the views belonged to."""
    tensors_of = _state_tensors(part)
    for index, (model_param, _) in enumerate(_owned_ranges(part)):
        tensors = tensors_of[id(model_param)]
        for box in param_state[index]:
            for key in PARAM_STATE_KEYS:
                loaded = box[key]
                target = tensors[key].detach().view(-1)[box["start"] : box["start"] + loaded.numel()]
                if target.data_ptr() != loaded.data_ptr():
                    target.copy_(loaded.reshape(-1))


def check_optimizer_kind(optimizer: MegatronOptimizer, saved: Any) -> None:
    """Refuse, naming the config field, a checkpoint whose optimizer (`saved`: its non-tensor state) was
    written with the other parallel.use_distributed_optimizer setting: the two store different tensors."""
    saved_distributed = _holds_key(saved, "param_state_sharding_type")
    distributed = bool(_distributed_parts(optimizer))
    if saved_distributed != distributed:
        raise ValueError(
            "the checkpoint's optimizer state was written with parallel.use_distributed_optimizer="
            f"{str(saved_distributed).lower()}, this run has {str(distributed).lower()}: resume with "
            f"parallel.use_distributed_optimizer={str(saved_distributed).lower()}"
        )


def _holds_key(state: Any, key: str) -> bool:
    if isinstance(state, dict):
        return key in state or any(_holds_key(value, key) for value in state.values())
    return isinstance(state, list) and any(_holds_key(value, key) for value in state)


def _part_states(state: Any, count: int) -> list[Any]:
    """The state of each optimizer of a chain, as ChainedOptimizer.load_state_dict splits it."""
    if count == 1:
        return [state]
    return [value for _, value in sorted(state.items())] if isinstance(state, dict) else list(state)


def _torch_adam(part: Any) -> bool:
    return isinstance(part.optimizer, torch.optim.Adam | torch.optim.AdamW)


def _exempts_some(state: Any) -> bool:
    """Whether any parameter group under `state` (a megatron optimizer state dict, nested or chained) has
    weight decay turned off by megatron-core's wd_mult."""
    if isinstance(state, list):
        return any(_exempts_some(part) for part in state)
    if not isinstance(state, dict):
        return False
    groups = state.get("param_groups")
    if isinstance(groups, list) and any(group.get("wd_mult", 1.0) == 0.0 for group in groups):
        return True
    return any(_exempts_some(value) for key, value in state.items() if key != "state")


def wrap_for_training(model: torch.nn.Module, parallel: ParallelConfig) -> torch.nn.Module:
    """megatron DDP: gradients accumulate in fp32 buffers, are reduced over data parallel (averaged)
    and, with pipeline parallelism, tied embeddings are reduced between the first and last stage."""
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=parallel.overlap_grad_reduce,
            overlap_param_gather=parallel.overlap_param_gather,
            use_distributed_optimizer=parallel.use_distributed_optimizer,
            # FP8 weights (model.fp8.param_gather) are gathered as FP8; the distributed optimizer keeps fp32
            # masters.
            fp8_param_gather=model.config.fp8_param,
        ),
        model,
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp


def _allocate_distributed_state(optimizer: MegatronOptimizer) -> None:
    """Give a fresh distributed optimizer over torch's Adam its state tensors (step 0, to be overwritten).

    Its sharded_state_dict reads its own state_dict(), which with torch's Adam (no Apex/TE) requires a `step`
    in every parameter's state: before the first step there is none. Allocated here by the inner optimizer's
    own parameters: megatron-core's allocation (its load_state_dict) sizes them by the lookup that
    `_state_tensors` explains, wrong where a group mixes fp32 and 16-bit parameters."""
    for part in _distributed_parts(optimizer):
        if len(part.optimizer.state) or not _torch_adam(part):
            continue
        for group in part.optimizer.param_groups:
            for main in group["params"]:
                part.optimizer.state[main] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(main),
                    "exp_avg_sq": torch.zeros_like(main),
                }


def _distributed_parts(optimizer: MegatronOptimizer) -> list[Any]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]
