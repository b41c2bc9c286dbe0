"""megatron-core's optimizer (AdamW, optional ZeRO-1 distributed optimizer) and learning-rate schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dapo_megatron.distributed.config import ParallelConfig
from dapo_megatron.models.config import ModelConfig
from dapo_megatron.trainer.config import OptimConfig

if TYPE_CHECKING:
    import torch
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


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
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
    TP x PP x DP layout. `is_loading`: a template to load into (allocates state a fresh optimizer lacks)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if is_loading:
        _allocate_distributed_state(optimizer)
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) == 1 and isinstance(parts[0], Float16OptimizerWithFloat16Params):
        return _mixed_precision_sharded_state(parts[0], model_state, is_loading)
    return optimizer.sharded_state_dict(model_state, is_loading, metadata=dict(_SHARDED_METADATA))


def _mixed_precision_sharded_state(
    part: Any, model_state: dict[str, Any], is_loading: bool
) -> dict[str, Any]:
    """Float16OptimizerWithFloat16Params.sharded_state_dict, with the same keys, for models that also hold
    fp32 parameters (the local layers' norms): megatron-core 0.16.1 numbers the optimizer's parameters as
    if all were bf16/fp16 and fails on the first fp32 one."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

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


# The distributed optimizer saves in 'fully_reshardable' form: its shards are gathered over DP and stored
# as tensors of each parameter's shape under that parameter's key, which TP, PP and DP may all change.
# 'dp_reshardable' keeps megatron's bucket layout (DP alone may change), and megatron's default
# 'fully_sharded_model_space' needs flattened tensors, which torch_dist no longer writes in 0.16.1.
_SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def load_optimizer_state(optimizer: MegatronOptimizer, state: Any) -> None:
    """`optimizer.load_state_dict(state)` (the loaded `sharded_optimizer_state`), refusing with the config
    field to set when the checkpoint's optimizer split the parameters differently into decayed and exempt
    ones (optim.decay_all_parameters)."""
    import torch

    saved, current = _exempts_some(state), _exempts_some({"param_groups": optimizer.param_groups})
    if saved != current:
        raise ValueError(
            f"the checkpoint's optimizer {'exempts' if saved else 'decays'} biases and norm weights "
            f"from weight decay, this run's {'exempts' if current else 'decays'} them: resume with "
            f"optim.decay_all_parameters={str(not saved).lower()}"
        )
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    # megatron-core 0.16.1 copies every entry of a parameter's torch-Adam state from the checkpoint,
    # `step` included, which its model-space tensors do not have (Apex/TE keep it in the param groups):
    # the distributed parts' tensors are loaded here, around the step counters.
    deferred = [
        (part, part_state.pop("param_state"), part_state.pop("param_state_sharding_type"))
        for part, part_state in zip(parts, _part_states(state, len(parts)), strict=True)
        if part in _distributed_parts(optimizer) and _torch_adam(part) and "param_state" in part_state
    ]
    with torch.no_grad():  # the fp32 masters are leaves that require grad; megatron copies into them in place
        optimizer.load_state_dict(state)
        for part, param_state, sharding_type in deferred:
            if sharding_type != _SHARDED_METADATA["distrib_optim_sharding_type"]:
                raise ValueError(f"unexpected distributed optimizer sharding type {sharding_type!r}")
            steps = {param: entry.pop("step") for param, entry in part.optimizer.state.items()}
            part.load_parameter_state_from_fully_reshardable(param_state)
            for param, step in steps.items():
                part.optimizer.state[param]["step"] = step
    # With torch's AdamW (no Apex/TE, e.g. on CPU) megatron-core 0.16.1's distributed optimizer hands every
    # parameter the same `step` tensor, which AdamW then increments once per parameter: the bias correction
    # would count parameters instead of steps. Each parameter gets its own counter.
    for part in parts:
        for param_state in part.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()


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
    import torch

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
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

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

    Its sharded_state_dict reads its own state_dict(), which with torch's Adam (no Apex/TE) requires one
    `step` shared by every parameter's state: before the first step there is none, and loading fails."""
    for part in _distributed_parts(optimizer):
        if len(part.optimizer.state) or not _torch_adam(part):
            continue
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in part.param_groups]
        part.load_state_dict({"optimizer": {"param_groups": groups}})


def _distributed_parts(optimizer: MegatronOptimizer) -> list[Any]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]
