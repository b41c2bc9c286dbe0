"""What megatron-core really allocates for a tiny bf16 Qwen2 under TP2, PP2 and DP2, with and without the
distributed optimizer, and what a training checkpoint of it writes (run under torchrun with 2 processes;
writes one JSON for all layouts).

Per rank and layout: bytes of the parameters, of the gradient buffers (`main_grad`), of the optimizer's
fp32 main parameters and of its state tensors after one step. Each is the sum over distinct storages,
so views into megatron's flat buffers count once, with their padding. The gradients are filled with
noise instead of a backward pass: the byte counts do not depend on where gradients come from. Then a
training checkpoint (`checkpoint.save_model`): the bytes of the tensor chunks each rank's files hold, read
from the checkpoint's metadata (the files also hold torch's framing of each chunk).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}


def model_config(tied: bool):
    from tests.model_configs import small_model_config

    # hidden 48 / 4 heads: head dim 12, so the QKV bias (96 elements) breaks the distributed optimizer's
    # 64-element alignment and the planner must reproduce megatron's padding.
    return small_model_config(
        num_layers=4,
        hidden_size=48,
        ffn_hidden_size=80,
        vocab_size=250,
        max_position_embeddings=64,
        params_dtype="bfloat16",
        transformer_impl="local",
        tie_word_embeddings=tied,
    )


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(size for pointer, size in storages.items() if pointer not in exclude)


def written_tensor_bytes(directory: Path) -> dict[int, int]:
    """Rank -> bytes of the tensor chunks stored in that rank's files of the torch_dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    written: dict[int, int] = {}
    for index, where in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):
            continue
        [chunk] = [c for c in entry.chunks if c.offsets == index.offset]
        rank = int(re.match(r"__(\d+)_", where.relative_path).group(1))
        written[rank] = written.get(rank, 0) + chunk.sizes.numel() * entry.properties.dtype.itemsize
    return written


def measure(tp: int, pp: int, distributed_optimizer: bool, tied: bool, root: Path) -> dict:
    from megatron.core import parallel_state

    from dapo_megatron import checkpoint
    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.trainer.actor import Actor
    from dapo_megatron.trainer.config import OptimConfig
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    cfg = model_config(tied)
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_distributed_optimizer=distributed_optimizer,
    )
    layout = initialize(parallel, seed=3)
    ddp = wrap_for_training(build_gpt_model(cfg, parallel, layout), parallel)
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(lr=1e-3), parallel, cfg)
    for buffer in ddp.buffers:
        buffer.grad_data.normal_()
    optimizer.step()
    actor = Actor(ddp, optimizer, scheduler, AlgoConfig(), layout, vocab_size=cfg.vocab_size)
    saved = checkpoint.save_model(ddp, root, 1, cfg, layout, training=actor, shared_state={"step": 1})

    params = list(ddp.module.parameters())
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    inner = [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])]
    main_params = [p for opt in inner for group in opt.param_groups for p in group["params"]]
    states = [state for opt in inner for state in opt.state.values()]
    return {
        "coordinates": [layout.tp_rank, layout.pp_rank, layout.dp_rank],
        "dp_size": layout.dp_size,
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.main_grad for p in params),
        # fp32 main params of bf16 weights are the optimizer's own tensors; fp32 weights are trained in place.
        "main_parameters": storage_bytes(main_params, exclude=model_storages),
        "moments": storage_bytes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq")),
        # Anything else the optimizer keeps beyond the scalar step counters, which the planner would miss.
        "other_state": storage_bytes(
            v for s in states for k, v in s.items() if k not in ("exp_avg", "exp_avg_sq") and v.numel() > 1
        ),
        "checkpoint_written": written_tensor_bytes(saved).get(layout.rank, 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from dapo_megatron.distributed.layout import shutdown

    results = {}
    for name, (tp, pp) in LAYOUTS.items():
        for distributed_optimizer in (False, True):
            tied = name == "pp2"  # a tied embedding split over stages gets its own bucket
            results[f"{name}-distopt{int(distributed_optimizer)}"] = {
                "tp": tp,
                "pp": pp,
                "distributed_optimizer": distributed_optimizer,
                "tied": tied,
                "measured": measure(
                    tp,
                    pp,
                    distributed_optimizer,
                    tied,
                    Path(args.out).parent / f"{name}-{distributed_optimizer}",
                ),
            }
    gathered: list[dict | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()
