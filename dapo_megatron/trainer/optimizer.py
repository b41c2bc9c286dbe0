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


def load_optimizer_state(optimizer: MegatronOptimizer, state: Any) -> None:
    """`optimizer.load_state_dict(state)`, refusing with the config field to set when the checkpoint's
    optimizer split the parameters differently into decayed and exempt ones (optim.decay_all_parameters)."""
    saved, current = _exempts_some(state), _exempts_some({"param_groups": optimizer.param_groups})
    if saved != current:
        raise ValueError(
            f"the checkpoint's optimizer {'exempts' if saved else 'decays'} biases and norm weights "
            f"from weight decay, this run's {'exempts' if current else 'decays'} them: resume with "
            f"optim.decay_all_parameters={str(not saved).lower()}"
        )
    optimizer.load_state_dict(state)


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


def parameter_state(optimizer: MegatronOptimizer) -> list[dict[str, Any]]:
    """The distributed optimizer's parameter state on this rank: fp32 master shards and Adam moments.

    `optimizer.state_dict()` leaves these out for megatron's distributed optimizer (they are sharded over
    data parallel and megatron saves them separately); without them a resume restarts Adam from zero
    moments and the masters from the bf16 weights. One entry per distributed optimizer in the chain, in
    megatron's bucket layout: restorable into the same model and layout. Empty without ZeRO-1.
    """
    states = []
    for part in _distributed_parts(optimizer):
        state = part.get_parameter_state_dp_reshardable()
        # The loader skips alignment padding entries by a flag that only megatron's sharded-checkpoint
        # path sets; every entry here is a real parameter.
        for key, by_dtype in state.items():
            if isinstance(key, int):
                for buckets in by_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry["padding"] = False
        states.append(state)
    return states


def load_parameter_state(optimizer: MegatronOptimizer, states: list[dict[str, Any]]) -> None:
    """Inverse of `parameter_state`; call after `optimizer.load_state_dict`, which allocates the state."""
    parts = _distributed_parts(optimizer)
    if len(parts) != len(states):
        raise ValueError(
            f"the checkpoint holds parameter state for {len(states)} distributed optimizer(s), this "
            f"run has {len(parts)}: resume with the parallel.use_distributed_optimizer setting (and "
            "layout) the checkpoint was written with"
        )
    import torch

    with torch.no_grad():  # the masters are leaves that require grad; megatron copies into them in place
        for part, state in zip(parts, states, strict=True):
            part.load_parameter_state_from_dp_reshardable(state)
            # With torch's AdamW (no Apex/TE, e.g. on CPU) megatron-core 0.16.1's load_state_dict hands every
            # parameter the same `step` tensor, which AdamW then increments once per parameter: the bias
            # correction would count parameters instead of steps. Each parameter gets its own counter.
            for param_state in part.optimizer.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].clone()


def _distributed_parts(optimizer: MegatronOptimizer) -> list[Any]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]
