"""Load a torch_dist checkpoint under a TP x PP layout (run under torchrun), write the full-vocab logits of
fixed tokens from rank 0, and optionally save the model again from this layout."""

from __future__ import annotations

import argparse
from typing import Any

import torch


def load_under_layout(checkpoint_dir: str, tp: int, pp: int) -> tuple[Any, Any, torch.nn.Module]:
    """(model config, layout, this rank's fp32 model) of a torch_dist checkpoint loaded at TP x PP. Also used
    by hf_export_worker.py (run from this folder, so it imports this file as a top-level module)."""
    from dapo_megatron import checkpoint
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize
    from dapo_megatron.models.qwen2 import build_gpt_model

    model_cfg = checkpoint.read_model_config(checkpoint_dir)
    model_cfg.params_dtype = "float32"
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    layout = initialize(parallel, seed=99)  # a different init: everything must come from the checkpoint
    model = build_gpt_model(model_cfg, parallel, layout)
    checkpoint.load_model(model, checkpoint_dir)
    return model_cfg, layout, model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-to", default=None)
    args = parser.parse_args()

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dapo_megatron import checkpoint
    from dapo_megatron.distributed.layout import shutdown

    model_cfg, layout, model = load_under_layout(args.checkpoint, args.tp, args.pp)
    model.eval()

    tokens = torch.randint(0, model_cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch, positions, None)

        def collect(output: torch.Tensor):
            shards = [torch.empty_like(output) for _ in range(layout.tp_size)]
            torch.distributed.all_gather(shards, output.contiguous(), group=layout.tp_group)
            return output.sum(), {"logits": torch.cat(shards, dim=-1)}

        return logits, collect

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=[model],
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
        )
    gathered = [None] * layout.world_size
    torch.distributed.all_gather_object(gathered, results[0]["logits"] if layout.is_loss_rank else None)
    if layout.rank == 0:
        logits = next(x for x in gathered if x is not None)
        torch.save({"tokens": tokens, "logits": logits}, args.out)
    if args.save_to:
        checkpoint.save_model(model, args.save_to, step=1, model_cfg=model_cfg, layout=layout)
    shutdown()


if __name__ == "__main__":
    main()
