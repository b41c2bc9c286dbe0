"""One gradient computation of the tiny Qwen2 under a TP x PP x DP layout (run under torchrun).

`--objective ce`: token-mean cross-entropy (the warm-up loss). `--objective dapo`: the DAPO policy loss
on sampled-looking sequences of uneven lengths, with old log-probs off the current policy so clipping
acts. Both go through the production path: megatron DDP, megatron-core's schedule, finalize_model_grads.

With `--reference` (one process) it first writes the initial weights and the batch, and the gradient of
the formula computed by plain autograd on the whole batch at once (plus the naive mean of micro-batch
means, which must differ). Every run writes its loss and full (TP-gathered, all stages) gradients.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ROWS, LENGTH, VOCAB = 8, 14, 250


def ce_rows() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH + 1), generator=g)
    mask = (torch.rand(ROWS, LENGTH, generator=g) > 0.3).float()
    mask[torch.arange(ROWS), torch.randint(4, LENGTH, (ROWS,), generator=g)] = 0.0
    return {"tokens": tokens, "mask": mask}


def dapo_rows() -> dict[str, torch.Tensor]:
    """Prompts of 3-6 tokens, responses of 1-9 tokens, right-padded: very uneven token counts per row."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.zeros(ROWS, LENGTH + 1, dtype=torch.long)
    mask = torch.zeros(ROWS, LENGTH)
    for row in range(ROWS):
        prompt, response = (
            int(torch.randint(3, 7, (1,), generator=g)),
            int(torch.randint(1, 10, (1,), generator=g)),
        )
        tokens[row, : prompt + response] = torch.randint(3, VOCAB, (prompt + response,), generator=g)
        mask[row, prompt - 1 : prompt - 1 + response] = 1.0  # label position t scores token t + 1
    advantages = torch.randn(ROWS, generator=g)
    return {"tokens": tokens, "mask": mask, "advantages": advantages}


def model_config():
    from tests.model_configs import small_model_config

    return small_model_config(
        num_layers=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        params_dtype="float32",
        transformer_impl="local",
    )


def dense_log_probs(model: torch.nn.Module, tokens: torch.Tensor, vocab: int | None = VOCAB) -> torch.Tensor:
    """log pi(token t+1 | <= t) with plain autograd; [rows, LENGTH]. The softmax covers the first `vocab`
    columns (the policy loss masks Megatron's vocab padding) or all of them (None: megatron-core's own
    cross-entropy, which the warm-up uses, includes the padding)."""
    inputs = tokens[:, :-1]
    logits = model(inputs, torch.arange(inputs.shape[1]).expand_as(inputs), None)[..., :vocab]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def formula_gradients(
    model: torch.nn.Module, batch: dict, objective: str, micro: int | None, loss_agg_mode: str = "token-mean"
) -> dict:
    """Gradients of the loss written out on the whole batch (micro=None), or of the naive mean of
    per-micro-batch means (micro=k), by plain autograd in this one process."""
    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.algo.loss import compute_policy_loss

    algo = AlgoConfig()
    chunks = (
        [slice(None)]
        if micro is None
        else [slice(i, i + ROWS // micro) for i in range(0, ROWS, ROWS // micro)]
    )
    model.zero_grad()
    losses = []
    for rows in chunks:
        mask = batch["mask"][rows]
        log_prob = dense_log_probs(model, batch["tokens"][rows], vocab=None if objective == "ce" else VOCAB)
        if objective == "ce":
            loss = -(log_prob * mask).sum() / mask.sum()
        else:
            loss, _ = compute_policy_loss(
                log_prob,
                batch["old_log_prob"][rows],
                batch["advantages"][rows],
                mask,
                clip_ratio_low=algo.clip_ratio_low,
                clip_ratio_high=algo.clip_ratio_high,
                clip_ratio_c=algo.clip_ratio_c,
                loss_agg_mode=loss_agg_mode,
            )
        losses.append(loss / len(chunks))
    total = torch.stack(losses).sum()
    total.backward()
    return {"loss": total.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objective", choices=["ce", "dapo"], required=True)
    parser.add_argument("--loss-agg-mode", default="token-mean")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, required=True, help="per data-parallel rank")
    parser.add_argument(
        "--recompute", action="store_true", help="full activation recompute, one layer per unit"
    )
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--max-tokens", type=int, help="token-budget micro-batches (dapo): planned by split_rows"
    )
    parser.add_argument("--dir", required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    root = Path(args.dir)

    from dapo_megatron.algo.config import AlgoConfig
    from dapo_megatron.distributed.config import ParallelConfig
    from dapo_megatron.distributed.layout import initialize, shutdown
    from dapo_megatron.models.qwen2 import build_gpt_model
    from dapo_megatron.models.weights import gather_full_state, load_full_state
    from dapo_megatron.records import MicroBatch, PolicyRows
    from dapo_megatron.trainer.actor import Actor, reduce_reports
    from dapo_megatron.trainer.batch import split_rows
    from dapo_megatron.trainer.config import OptimConfig, TrainerConfig
    from dapo_megatron.trainer.forward import run_schedule
    from dapo_megatron.trainer.optimizer import build_optimizer, wrap_for_training
    from dapo_megatron.trainer.warmup import token_sum

    cfg = model_config()
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        recompute_granularity="full" if args.recompute else "none",
        sequence_parallel=args.sequence_parallel,
    )
    layout = initialize(parallel, seed=7)
    model = build_gpt_model(cfg, parallel, layout)
    if args.reference:
        torch.save(gather_full_state(model, cfg, layout), root / "weights.pt")
        batch = ce_rows() if args.objective == "ce" else dapo_rows()
        if args.objective == "dapo":
            with torch.no_grad():  # old policy = current one with noise: ratios spread over both clip bounds
                noise = torch.randn(ROWS, LENGTH, generator=torch.Generator().manual_seed(2)) * 0.4
                batch["old_log_prob"] = dense_log_probs(model, batch["tokens"]) + noise
        torch.save(batch, root / f"{args.objective}_batch.pt")
        formula = formula_gradients(model, batch, args.objective, micro=None)
        naive = formula_gradients(model, batch, args.objective, micro=4)
        seq_mean = formula_gradients(
            model, batch, args.objective, micro=None, loss_agg_mode="seq-mean-token-mean"
        )
        torch.save(
            {"formula": formula, "naive": naive, "seq-mean-token-mean": seq_mean},
            root / f"{args.objective}_formula.pt",
        )
    else:
        load_full_state(model, torch.load(root / "weights.pt"), cfg, layout)
    batch = torch.load(root / f"{args.objective}_batch.pt")

    forward_calls: list[int] = []  # of this stage's first layer: twice per micro-batch under full recompute
    model.decoder.layers[0].register_forward_hook(lambda *_: forward_calls.append(1))
    model_widths: list[int] = []  # sequence lengths the model was given, padding included
    model.register_forward_pre_hook(lambda _, args: model_widths.append(args[0].shape[1]))
    ddp = wrap_for_training(model, parallel)
    extra: dict[str, float] = {}
    share = ROWS // layout.dp_size
    mine = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
    mb_size = share // args.micro_batches
    if args.objective == "ce":
        tokens, mask = batch["tokens"][mine], batch["mask"][mine]
        micro = [
            MicroBatch(
                tokens=tokens[i : i + mb_size, :-1],
                labels=tokens[i : i + mb_size, 1:],
                loss_mask=mask[i : i + mb_size],
            )
            for i in range(0, share, mb_size)
        ]
        ddp.zero_grad_buffer()
        reports = run_schedule(ddp, micro, token_sum, forward_only=False, with_labels=True)
        reports = [{"loss_sum": r["loss_sum"], "units": r["tokens"]} for r in reports]
    else:
        optimizer, scheduler = build_optimizer(ddp, OptimConfig(lr=1e-3), parallel, cfg)
        actor = Actor(
            ddp, optimizer, scheduler, AlgoConfig(loss_agg_mode=args.loss_agg_mode), layout, vocab_size=VOCAB
        )
        rows = PolicyRows(
            tokens=batch["tokens"],
            response_mask=batch["mask"],
            advantages=batch["advantages"],
            old_log_prob=batch["old_log_prob"],
        )
        # One optimizer step; this rank's rows and micro-batches as the trainer plans them.
        work = split_rows(
            rows,
            layout.dp_size,
            layout.dp_rank,
            TrainerConfig(
                train_batch_size=1,
                ppo_mini_batch_size=1,
                micro_batch_size=mb_size,
                max_tokens_per_micro_batch=args.max_tokens,
            ),
        )
        reports = actor.backward(work.rows, work.micro_batch_sizes[0])
        if args.max_tokens:  # the planned micro-batches must map log-probs back to their rows
            planned = actor.compute_log_probs(work.rows, work.micro_batch_sizes[0])
            one_by_one = actor.compute_log_probs(work.rows, 1)
            extra["log_prob_gap"] = float((planned - one_by_one).abs().max())
    metrics = reduce_reports(reports, layout)
    grads = gather_full_state(ddp, cfg, layout, tensor_of=lambda p: p.main_grad)
    if layout.rank == 0:
        torch.save(
            {
                "loss": metrics["loss"],
                "units": metrics["units"],
                "grads": grads,
                "layer_forward_calls": len(forward_calls),
                "model_widths": model_widths,
                **extra,
            },
            args.out,
        )
    shutdown()


if __name__ == "__main__":
    main()
