"""Exact resume of the policy update (run under torchrun): optimizer, LR schedule and RNG states.

`--mode continuous` trains 4 DAPO steps, checkpointing after steps 1 and 2 (keeping the last one);
`--mode resume` starts from other weights, loads that checkpoint and trains steps 3-4. Each step draws its
advantages from torch's global RNG, so a resume that forgot the RNG state would train on different data.
Rank 0 writes the losses and the final full weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from equivalence_worker import dapo_rows, model_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["continuous", "resume"], required=True)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    root = Path(args.dir)

    from dapo_megatron import checkpoint
    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.models.weights import gather_full_state
    from dapo_megatron.records import PolicyRows
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.config import OptimConfig
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training

    cfg = model_config()
    parallel = ParallelConfig(
        pipeline_model_parallel_size=args.pp, use_distributed_optimizer=args.distributed_optimizer
    )
    layout = initialize(parallel, seed=7 if args.mode == "continuous" else 8)
    model = wrap_for_training(build_gpt_model(cfg, parallel, layout), parallel)
    # Two optimizer steps per step below: the 6-step warm-up spans the checkpoint of step 2.
    optimizer, scheduler = build_optimizer(
        model, OptimConfig(lr=1e-3, lr_warmup_rollout_steps=3, weight_decay=0.1), parallel, cfg, 2
    )
    actor = Actor(model, optimizer, scheduler, AlgoConfig(), layout, vocab_size=cfg.vocab_size)
    batch = dapo_rows()

    first = 1
    if args.mode == "resume":
        checkpoint.load_model(model, root / "checkpoints")
        rank_state, shared = checkpoint.load_training_state(root / "checkpoints", layout)
        actor.load_state_dict(rank_state)
        first = shared["step"] + 1
    losses = {}
    for step in range(first, 5):
        rows = PolicyRows(
            tokens=batch["tokens"], response_mask=batch["mask"], advantages=torch.randn(len(batch["mask"]))
        )
        rows.old_log_prob = actor.compute_log_probs(rows, micro_batch_size=4)
        losses[step] = actor.train_step(rows.subset(slice(0, 4)), micro_batch_size=2)["loss"]
        losses[step] += actor.train_step(rows.subset(slice(4, 8)), micro_batch_size=2)["loss"]
        if (
            args.mode == "continuous" and step <= 2
        ):  # keep_last=1: step 1's checkpoint goes once step 2's is complete
            checkpoint.save_model(
                model,
                root / "checkpoints",
                step,
                cfg,
                layout,
                rank_state=actor.state_dict(),
                shared_state={"step": step},
                keep_last=1,
            )
    weights = gather_full_state(model, cfg, layout)
    if layout.rank == 0:
        torch.save({"losses": losses, "weights": weights}, root / f"{args.mode}.pt")
    shutdown()


if __name__ == "__main__":
    main()
