"""One training micro-step of the tiny Qwen2 under a given TP x PP x DP layout (run under torchrun).

With `--save-weights` (single process) it writes the model's initial full weights; otherwise it loads
them, so every layout computes with identical weights. It runs several micro-batches through
megatron-core's forward-backward schedule with megatron DDP, then writes the mean loss and every
full (TP-gathered, all stages) gradient to `--out` from rank 0.
"""

from __future__ import annotations

import argparse

import torch


def micro_batches(count: int, batch: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        loss_mask = (torch.rand(batch, seq, generator=g) > 0.3).float()
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1), "loss_mask": loss_mask})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--save-weights", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--global-micro-batches", type=int, default=4)
    args = parser.parse_args()

    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.config import ModelConfig
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.models.weights import gather_full_state, load_full_state

    model_cfg = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=2, vocab_size=250, max_position_embeddings=64,
                            params_dtype="float32", transformer_impl="local")
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    layout = initialize(parallel, seed=7)
    model = build_gpt_model(model_cfg, parallel, layout)
    if args.save_weights:
        torch.save(gather_full_state(model, model_cfg, layout), args.weights)
    else:
        load_full_state(model, torch.load(args.weights), model_cfg, layout)

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync

    seq, batch = 12, 2
    per_rank = args.global_micro_batches // layout.dp_size
    mine = micro_batches(args.global_micro_batches, batch, seq, model_cfg.vocab_size)[
        layout.dp_rank * per_rank:(layout.dp_rank + 1) * per_rank]
    positions = torch.arange(seq).expand(batch, -1)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        per_token = model(mb["tokens"], positions, None, labels=mb["labels"])

        def loss_func(output: torch.Tensor):
            loss = (output.float() * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
            return loss, {"loss": loss.detach().clone()}

        return per_token, loss_func

    ddp.zero_grad_buffer()
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mine), model=[ddp], num_microbatches=per_rank,
        seq_length=seq, micro_batch_size=batch, forward_only=False)

    local_losses = [r["loss"].item() for r in results] if layout.is_loss_rank else []
    all_losses = [None] * layout.world_size
    torch.distributed.all_gather_object(all_losses, local_losses)
    grads = gather_full_state(ddp, model_cfg, layout, tensor_of=lambda p: p.main_grad)
    if layout.rank == 0:
        losses = [x for part in all_losses for x in part]
        assert len(losses) == args.global_micro_batches, losses
        torch.save({"loss": sum(losses) / len(losses), "grads": grads}, args.out)
    shutdown()


if __name__ == "__main__":
    main()
