"""Vocab-parallel log-prob/entropy at TP2: two gloo processes, each holding half of the vocab."""

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapo_megatron.algo.logprobs import vocab_parallel_logprobs

WORLD_SIZE = 2
TOKENS, SHARD_WIDTH = 11, 16
# (temperature, true vocab size, chunk size): no padding; padding inside rank 1's shard;
# rank 1's shard entirely padding (it must still join the collectives).
CASES = [(1.0, 2 * SHARD_WIDTH, 4), (0.75, 2 * SHARD_WIDTH - 5, 3), (1.3, SHARD_WIDTH - 2, 64)]


def _dense(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int
) -> tuple[torch.Tensor, ...]:
    z = (logits / temperature).masked_fill(torch.arange(logits.shape[-1]) >= vocab_size, -torch.inf)
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)
    return log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _worker(rank: int, store_path: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),  # fail instead of hanging if a rank skips a collective
    )
    try:
        group = dist.new_group(list(range(WORLD_SIZE)))
        columns = slice(rank * SHARD_WIDTH, (rank + 1) * SHARD_WIDTH)
        for case_index, (temperature, vocab_size, chunk_size) in enumerate(CASES):
            gen = torch.Generator().manual_seed(case_index)  # same full tensors on both ranks
            full = torch.randn(TOKENS, WORLD_SIZE * SHARD_WIDTH, generator=gen, dtype=torch.float64) * 3
            labels = torch.randint(0, vocab_size, (TOKENS,), generator=gen)
            w_lp = torch.randn(TOKENS, generator=gen, dtype=torch.float64)
            w_h = torch.randn(TOKENS, generator=gen, dtype=torch.float64)

            shard = full[:, columns].clone().requires_grad_()
            lp, ent = vocab_parallel_logprobs(
                shard,
                labels,
                temperature=temperature,
                vocab_size=vocab_size,
                process_group=group,
                chunk_size=chunk_size,
            )
            ((lp * w_lp).sum() + (ent * w_h).sum()).backward()

            ref_in = full.clone().requires_grad_()
            ref_lp, ref_ent = _dense(ref_in, labels, temperature, vocab_size)
            ((ref_lp * w_lp).sum() + (ref_ent * w_h).sum()).backward()

            torch.testing.assert_close(lp, ref_lp, msg=lambda m, c=case_index: f"rank {rank} case {c}: {m}")
            torch.testing.assert_close(ent, ref_ent, msg=lambda m, c=case_index: f"rank {rank} case {c}: {m}")
            torch.testing.assert_close(
                shard.grad, ref_in.grad[:, columns], msg=lambda m, c=case_index: f"rank {rank} case {c}: {m}"
            )

            lp_only, no_entropy = vocab_parallel_logprobs(
                full[:, columns],
                labels,
                temperature=temperature,
                vocab_size=vocab_size,
                process_group=group,
                compute_entropy=False,
            )
            assert no_entropy is None
            torch.testing.assert_close(lp_only, ref_lp)
    finally:
        dist.destroy_process_group()


def test_tp2_matches_dense(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD_SIZE, join=True)
