"""The weights that leave the trainer after an update, with `parallel.overlap_param_gather` (run under
torchrun, DP2 on gloo, the distributed optimizer).

Two policies from the same initial weights train the same optimizer step: one with the flag (megatron-core
defers the all-gather of the updated parameters to the next forward's pre-hooks), one without (it gathers
inside the step). Then each reader of the weights outside a forward pass runs on the deferred one: the HF
export, a checkpoint, the full-state gather. Every reader must see the synchronous policy's weights. Rank 0
writes, per reader, the largest difference, and how far the deferred policy's own parameters were from them
before any reader ran (which must be > 0, or the case shows nothing).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from equivalence_worker import model_config
from resume_worker import build, train_step

from dapo_megatron import checkpoint
from dapo_megatron.models.weights import export_hf, gather_full_state, local_params


def local_weights(model: torch.nn.Module, layout) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in local_params(model, model_config(), layout)}


def largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def read_export(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(file).items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    distributed = {"use_distributed_optimizer": True, "overlap_grad_reduce": True}

    layout, model, actor = build({**distributed, "overlap_param_gather": False}, seed=7)
    train_step(actor, layout, 1, seeded=True)
    expected_local = local_weights(model, layout)
    expected_full = gather_full_state(model, model_config(), layout)
    export_hf(model, model_config(), layout, args.dir / "expected_hf")

    gaps: dict[str, float] = {}
    for reader in ("stale", "export_hf", "checkpoint", "gather_full_state"):
        layout, model, actor = build({**distributed, "overlap_param_gather": True}, seed=7)
        train_step(actor, layout, 1, seeded=True)
        if reader == "stale":  # no reader: the parameters as the step left them
            gaps[reader] = largest_gap(local_weights(model, layout), expected_local)
        elif reader == "export_hf":
            export_hf(model, model_config(), layout, args.dir / "hf")
            if layout.rank == 0:
                gaps[reader] = largest_gap(
                    read_export(args.dir / "hf"), read_export(args.dir / "expected_hf")
                )
        elif reader == "checkpoint":
            checkpoint.save_model(model, args.dir / "checkpoints", 1, model_config(), layout)
            _, fresh, _ = build({**distributed, "overlap_param_gather": False}, seed=8)
            checkpoint.load_model(fresh, args.dir / "checkpoints")
            gaps[reader] = largest_gap(local_weights(fresh, layout), expected_local)
        else:
            full = gather_full_state(model, model_config(), layout)
            if layout.rank == 0:
                gaps[reader] = largest_gap(full, expected_full)
    every = [None] * layout.world_size
    torch.distributed.all_gather_object(every, gaps)
    if layout.rank == 0:
        torch.save(every, args.dir / "gaps.pt")


if __name__ == "__main__":
    main()
