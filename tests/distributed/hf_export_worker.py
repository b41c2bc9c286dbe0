"""Load a torch_dist checkpoint under a TP x PP layout (run under torchrun) and export it the way training
does (`weights.export_hf`); then export again to the same directory with the last stage's second shard write
failing. Rank 0 writes every rank's outcome of the second export to --result (JSON)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--base-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()

    from checkpoint_logits_worker import load_under_layout

    from dapo_megatron.distributed.layout import shutdown
    from dapo_megatron.models import hf_export
    from dapo_megatron.models.weights import export_hf

    model_cfg, layout, model = load_under_layout(args.checkpoint, args.tp, args.pp)
    # Small shards, so that each stage writes several and the failure below comes mid-way.
    exported = export_hf(
        model, model_cfg, layout, args.out, tokenizer_dir=args.base_dir, max_shard_bytes=40_000
    )
    assert (exported is not None) == (layout.rank == 0)

    if layout.pp_rank == layout.pp_size - 1:
        write, calls = hf_export.write_safetensors, []

        def failing_write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
            calls.append(path)
            if len(calls) == 2:
                raise OSError("No space left on device (injected)")
            write(path, tensors)

        hf_export.write_safetensors = failing_write
    try:
        export_hf(model, model_cfg, layout, args.out, tokenizer_dir=args.base_dir, max_shard_bytes=40_000)
        outcome = "no error"
    except RuntimeError as error:
        outcome = str(error)
    outcomes = [None] * layout.world_size
    torch.distributed.all_gather_object(outcomes, outcome)
    if layout.rank == 0:
        Path(args.result).write_text(json.dumps(outcomes))
    shutdown()


if __name__ == "__main__":
    main()
