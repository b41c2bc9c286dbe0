"""Where a training checkpoint's bytes are written and what a save costs in host memory (run under torchrun).

`--mode spread --tp N`: a policy with the distributed optimizer, at TP N x DP (world / N), trains one step
and saves a training checkpoint through `checkpoint.save_model`; `--old-format` saves the same state as this
project did before (megatron-core's `fully_reshardable` optimizer state, the default torch_dist strategy).
fp32 parameters: megatron-core's own `fully_reshardable` cannot save bf16 local layers (see
`trainer.optimizer._state_tensors`). Every rank writes `rank<r>.json`: the bytes of the `.distcp` files it
wrote, and its peak host memory above its resident memory while saving (VmHWM after the save, reset to VmRSS
before it).

`--mode old_checkpoint`: an old-format checkpoint (as above) and a new one of the same training state, written
at DP 2, are each resumed at TP 2 (`checkpoint.load_model` + `load_training_state`) and trained one more step;
rank 0 writes both runs' full weights to `old_checkpoint.pt`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import torch
from resume_worker import train_step

# 12.6M parameters: large enough that the optimizer's state (12 bytes per parameter, 151 MB) dwarfs what a
# save allocates besides the tensors it writes.
SIZES = {
    "num_layers": 4,
    "hidden_size": 512,
    "ffn_hidden_size": 1024,
    "num_attention_heads": 8,
    "num_query_groups": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 64,
}


def model_config(dtype: str, sizes: dict[str, int] | None = None) -> Any:
    from tests.model_configs import small_model_config

    return small_model_config(**(sizes or SIZES), params_dtype=dtype, transformer_impl="local")


def build(parallel_kwargs: dict[str, Any], cfg: Any) -> tuple[Any, Any, Any]:
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
    parallel = ParallelConfig(**parallel_kwargs, use_distributed_optimizer=True)
    layout = initialize(parallel, seed=7)
    model = wrap_for_training(build_gpt_model(cfg, parallel, layout), parallel)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1), parallel, cfg)
    return layout, model, Actor(model, optimizer, scheduler, AlgoConfig(), layout, vocab_size=cfg.vocab_size)


class OldFormat:
    """The actor's training state as this project saved it before: megatron-core's `fully_reshardable`
    distributed-optimizer state (gathered over DP on every rank, written by DP rank 0)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def sharded_state_dict(self, model_state: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
        return {
            "optimizer": self.actor.optimizer.sharded_state_dict(model_state, is_loading, metadata=metadata),
            "scheduler": self.actor.scheduler.state_dict(),
        }

    def rank_state_dict(self) -> dict[str, Any]:
        return self.actor.rank_state_dict()


def save(model: Any, actor: Any, root: Path, cfg: Any, layout: Any, *, old_format: bool) -> Path:
    from dapo_megatron import checkpoint

    if not old_format:
        return checkpoint.save_model(model, root, 1, cfg, layout, training=actor, shared_state={"step": 1})
    default = checkpoint._save_strategy
    checkpoint._save_strategy = lambda: None  # the strategy the old code used: torch_dist's default
    try:
        return checkpoint.save_model(
            model, root, 1, cfg, layout, training=OldFormat(actor), shared_state={"step": 1}
        )
    finally:
        checkpoint._save_strategy = default


def host_memory_kib() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {key: int(value) for key, value in re.findall(r"(VmHWM|VmRSS):\s+(\d+) kB", status)}


def spread(root: Path, tp: int, old_format: bool) -> None:
    import gc

    cfg = model_config("float32")
    layout, model, actor = build({"tensor_model_parallel_size": tp}, cfg)
    train_step(actor, layout, 1, seeded=True)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = host_memory_kib()["VmRSS"]
    directory = save(model, actor, root / "checkpoints", cfg, layout, old_format=old_format)
    peak = host_memory_kib()["VmHWM"]
    written = sum(file.stat().st_size for file in directory.glob(f"__{layout.rank}_*.distcp"))
    (root / f"rank{layout.rank}.json").write_text(
        json.dumps({"rank": layout.rank, "written_bytes": written, "save_host_bytes": (peak - before) * 1024})
    )


def old_checkpoint(root: Path) -> None:
    from dapo_megatron import checkpoint
    from dapo_megatron.models.weights import gather_full_state

    cfg = model_config("float32", {**SIZES, "hidden_size": 64, "ffn_hidden_size": 128, "vocab_size": 250})
    results = {}
    for old_format in (True, False):
        layout, model, actor = build({}, cfg)
        for step in (1, 2):
            train_step(actor, layout, step, seeded=True)
        case = root / ("old" if old_format else "new")
        save(model, actor, case, cfg, layout, old_format=old_format)
        layout, model, actor = build({"tensor_model_parallel_size": 2}, cfg)
        checkpoint.load_model(model, case)
        checkpoint.load_training_state(model, case, layout, actor)
        train_step(actor, layout, 3, seeded=True)
        results["old" if old_format else "new"] = gather_full_state(model, cfg, layout)
    if layout.rank == 0:
        torch.save(results, root / "old_checkpoint.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["spread", "old_checkpoint"], required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--old-format", action="store_true")
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()

    from dapo_megatron.distributed.layout import shutdown

    if args.mode == "spread":
        spread(Path(args.dir), args.tp, args.old_format)
    else:
        old_checkpoint(Path(args.dir))
    shutdown()


if __name__ == "__main__":
    main()
