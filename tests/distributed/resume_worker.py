"""Resume of the policy update (run under torchrun): optimizer, LR schedule and RNG states.

`--mode continuous` trains 4 DAPO steps, checkpointing after steps 1 and 2 (keeping the last one);
`--mode resume` starts from other weights, loads that checkpoint and trains steps 3-4. Each step draws its
advantages from torch's global RNG, so a resume that forgot the RNG state would train on different data.
Rank 0 writes the losses and the final full weights.

`--mode reshard` resumes under another layout, for each case of `RESHARD_CASES` in this one job (the
model-parallel groups are rebuilt between phases; each phase builds its own model and optimizer):
A trains steps 1-2 under layout X and checkpoints; B loads that checkpoint under layout Y and trains step 3;
C trains steps 1-3 under layout Y from A's initial weights, uninterrupted; B' is B with Adam's moments
zeroed after loading (what a resume that lost them would do). Advantages come from a generator seeded by
the step, the same in every layout. Rank 0 writes every phase's final full weights.

`--mode offload` trains 3 steps of a bf16 policy with the distributed optimizer twice from the same initial
weights: once as is, once with its state offloaded to host memory after each step and reloaded before the
next (`trainer/offload.py`). Every rank checks that each offload released every storage of its state and
that each reload brought every byte back; rank 0 writes both runs' losses and final full weights.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch
from equivalence_worker import dapo_rows, model_config

# (name, parameter dtype, layout X, layout Y) with ParallelConfig keyword arguments, for two processes. bf16
# parameters beside the local layers' fp32 norms take megatron-core's mixed-precision optimizer, or with the
# distributed optimizer parameter groups that mix fp32 and bf16 shards; their fp32 masters are saved too, and
# in one layout the resume is bit-exact.
RESHARD_CASES = (
    (
        "zero1_dp2_to_tp2",
        "float32",
        {"use_distributed_optimizer": True},
        {"tensor_model_parallel_size": 2, "use_distributed_optimizer": True},
    ),
    ("tp2_to_pp2", "float32", {"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}),
    ("bf16_tp2", "bfloat16", {"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 2}),
    ("bf16_zero1_dp2", "bfloat16", {"use_distributed_optimizer": True}, {"use_distributed_optimizer": True}),
)


def build(parallel_kwargs: dict[str, Any], seed: int, dtype: str = "float32") -> tuple[Any, Any, Any]:
    """(layout, DDP-wrapped model, actor) under a fresh set of model-parallel groups."""
    from megatron.core import parallel_state

    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.config import OptimConfig
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cfg = dataclasses.replace(model_config(), params_dtype=dtype)
    parallel = ParallelConfig(**parallel_kwargs)
    layout = initialize(parallel, seed=seed)
    model = wrap_for_training(build_gpt_model(cfg, parallel, layout), parallel)
    # Two optimizer steps per step below: the 6-step warm-up spans the checkpoint of step 2.
    optimizer, scheduler = build_optimizer(
        model, OptimConfig(lr=1e-3, lr_warmup_rollout_steps=3, weight_decay=0.1), parallel, cfg, 2
    )
    return layout, model, Actor(model, optimizer, scheduler, AlgoConfig(), layout, vocab_size=cfg.vocab_size)


def train_step(actor: Any, layout: Any, step: int, *, seeded: bool) -> float:
    """One DAPO step: two optimizer steps of 4 rows each, every DP rank taking its share of them."""
    from dapo_megatron.records import PolicyRows

    batch = dapo_rows()
    generator = torch.Generator().manual_seed(step) if seeded else None
    rows = PolicyRows(
        tokens=batch["tokens"],
        response_mask=batch["mask"],
        advantages=torch.randn(len(batch["mask"]), generator=generator),
    )
    rows.old_log_prob = actor.compute_log_probs(rows, micro_batch_size=4)
    share = 4 // layout.dp_size
    loss = 0.0
    for start in (0, 4):
        mine = start + layout.dp_rank * share
        loss += actor.train_step(rows.subset(slice(mine, mine + share)), micro_batch_size=2)["loss"]
    return loss


def exact_resume(mode: str, parallel_kwargs: dict[str, Any], root: Path) -> None:
    from dapo_megatron import checkpoint
    from dapo_megatron.models.weights import gather_full_state

    layout, model, actor = build(parallel_kwargs, seed=7 if mode == "continuous" else 8)
    first = 1
    if mode == "resume":
        checkpoint.load_model(model, root / "checkpoints")
        first = checkpoint.load_training_state(model, root / "checkpoints", layout, actor)["step"] + 1
    losses = {}
    for step in range(first, 5):
        losses[step] = train_step(actor, layout, step, seeded=False)
        # keep_last=1: step 1's checkpoint goes once step 2's is complete
        if mode == "continuous" and step <= 2:
            checkpoint.save_model(
                model,
                root / "checkpoints",
                step,
                model_config(),
                layout,
                training=actor,
                shared_state={"step": step},
                keep_last=1,
            )
    weights = gather_full_state(model, model_config(), layout)
    if layout.rank == 0:
        torch.save({"losses": losses, "weights": weights}, root / f"{mode}.pt")


def reshard(root: Path) -> None:
    from dapo_megatron import checkpoint
    from dapo_megatron.models.weights import gather_full_state

    results = {}
    for name, dtype, before, after in RESHARD_CASES:
        case, cfg = root / name, dataclasses.replace(model_config(), params_dtype=dtype)
        layout, model, actor = build(before, seed=7, dtype=dtype)
        checkpoint.save_model(model, case / "init", 0, cfg, layout)
        for step in (1, 2):
            train_step(actor, layout, step, seeded=True)
        checkpoint.save_model(
            model, case / "checkpoints", 2, cfg, layout, training=actor, shared_state={"step": 2}
        )
        weights = {}
        for phase in ("resumed", "moments_reset", "uninterrupted"):
            layout, model, actor = build(after, seed=8, dtype=dtype)
            if phase == "uninterrupted":
                checkpoint.load_model(model, case / "init")
                actor.optimizer.reload_model_params()  # masters from the loaded bf16 weights, as in Policy
                steps = [1, 2, 3]
            else:
                checkpoint.load_model(model, case / "checkpoints")
                shared = checkpoint.load_training_state(model, case / "checkpoints", layout, actor)
                steps = [shared["step"] + 1]
            if phase == "moments_reset":
                for part in actor.optimizer.chained_optimizers:  # the moments a lossy resume drops
                    for state in part.optimizer.state.values():
                        state["exp_avg"].zero_()
                        state["exp_avg_sq"].zero_()
            for step in steps:
                train_step(actor, layout, step, seeded=True)
            weights[phase] = gather_full_state(model, cfg, layout)
        results[name] = weights
    if layout.rank == 0:
        torch.save(results, root / "reshard.pt")


def state_tensors(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a rank's training state, by name: parameters, their main_grad views, DDP's buffers, the
    optimizer's (fp32 main) parameters and its state (Adam's moments)."""
    tensors = {}
    for name, param in model.named_parameters():
        tensors[f"param {name}"] = param
        tensors[f"main_grad {name}"] = param.main_grad
    for index, buffer in enumerate(model.buffers):
        tensors[f"buffer {index} grad_data"] = buffer.grad_data
        if buffer.param_data is not None:
            tensors[f"buffer {index} param_data"] = buffer.param_data
    for part_index, part in enumerate(optimizer.chained_optimizers):
        for index, param in enumerate(p for group in part.optimizer.param_groups for p in group["params"]):
            tensors[f"optimizer {part_index} param {index}"] = param
            for key, value in part.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer {part_index} param {index} {key}"] = value
    return tensors


def offload_round_trip(offload: Any, model: Any, optimizer: Any) -> None:
    """offload -> every storage of the state released -> reload -> every tensor bit-identical (raises if
    not)."""
    tensors = state_tensors(model, optimizer)
    before = {name: tensor.detach().clone() for name, tensor in tensors.items()}
    offload.offload()
    kept = [name for name, tensor in tensors.items() if tensor.untyped_storage().nbytes()]
    assert not kept, f"not released: {kept[:4]} ({len(kept)} in all)"
    offload.reload()
    for name, tensor in tensors.items():
        assert torch.equal(
            tensor.reshape(-1).view(torch.uint8), before[name].reshape(-1).view(torch.uint8)
        ), name


def offload_equivalence(root: Path) -> None:
    from dapo_megatron.models.weights import gather_full_state
    from dapo_megatron.trainer.offload import TrainerStateOffload

    results = {}
    for offloading in (False, True):
        layout, model, actor = build({"use_distributed_optimizer": True}, seed=7, dtype="bfloat16")
        offload = TrainerStateOffload(model, actor.optimizer)
        losses = []
        for step in (1, 2, 3):
            losses.append(train_step(actor, layout, step, seeded=True))
            if offloading:
                offload_round_trip(offload, model, actor.optimizer)
        cfg = dataclasses.replace(model_config(), params_dtype="bfloat16")
        results[offloading] = {"losses": losses, "weights": gather_full_state(model, cfg, layout)}
    if layout.rank == 0:
        torch.save(results, root / "offload.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["continuous", "resume", "reshard", "offload"], required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()

    from dapo_megatron.distributed.layout import shutdown

    if args.mode == "reshard":
        reshard(Path(args.dir))
    elif args.mode == "offload":
        offload_equivalence(Path(args.dir))
    else:
        parallel = {
            "pipeline_model_parallel_size": args.pp,
            "use_distributed_optimizer": args.distributed_optimizer,
        }
        exact_resume(args.mode, parallel, Path(args.dir))
    shutdown()


if __name__ == "__main__":
    main()
