"""Run the policy over micro-batches through megatron-core's pipeline schedule.

Every forward pass of the trainer goes through `get_forward_backward_func()`, so the same code runs
under any TP x PP layout: the schedule owns micro-batching and pipeline communication, and callers
supply what happens to the last stage's output (`loss_fn`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.models.sequence_padding import model_sequence_multiple, padded_length
from dapo_megatron.records import MicroBatch

LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]
"""(micro-batch, last-stage output) -> (loss SUM over the micro-batch's units, number of units as an
int tensor, values to report).

The models run with megatron-core's `calculate_per_token_loss`: the schedule adds up the unit counts of
all micro-batches, `finalize_model_grads` all-reduces that total over data parallel and divides every
gradient by it, and DDP does not average over ranks. The gradient is therefore that of
sum(all unit losses of the optimizer batch) / (all units), exactly, for any DP size and micro-batch
split. A unit is a token for token-mean losses and a sequence for sequence-mean losses.
"""


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    with_labels: bool,
) -> list[dict[str, Any]]:
    """Forward (and backward unless `forward_only`) over `micro_batches` on this rank's model chunk.

    With `with_labels` the last stage outputs per-token cross-entropy [batch, seq] (computed by
    megatron-core over the vocab-parallel logits); otherwise vocab-parallel logits [batch, seq, V/tp].
    Returns the report dicts of `loss_fn`, one per micro-batch, on the last pipeline stage only.

    The model sees each micro-batch right-padded to the length that sequence parallelism and FP8 need
    (`models/sequence_padding.py`); causal attention keeps the padding from touching real positions,
    and `loss_fn` gets the output cut back to the micro-batch's own width.
    """
    multiple = model_sequence_multiple(model.config)

    device = next(model.parameters()).device

    def forward_step(data_iterator, chunk):  # type: ignore[no-untyped-def]
        # Batches are built on the CPU; the loss function needs them beside the model's outputs.
        mb = next(data_iterator)
        mb = dataclasses.replace(
            mb,
            **{
                f.name: value.to(device, non_blocking=True)
                for f in dataclasses.fields(mb)
                if isinstance(value := getattr(mb, f.name), torch.Tensor)
            },
        )
        width = mb.tokens.shape[1]
        padding = (0, -width % multiple)
        tokens = torch.nn.functional.pad(mb.tokens, padding)
        labels = torch.nn.functional.pad(mb.labels, padding) if with_labels else None
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        output = chunk(tokens, positions, None, labels=labels)
        return output, lambda out: loss_fn(mb, out[:, :width])

    seq_length = padded_length(max(mb.tokens.shape[1] for mb in micro_batches), multiple)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batches[0].tokens.shape[0],
        forward_only=forward_only,
    )


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, layout: ParallelLayout, vocab_size: int) -> torch.Tensor:
    """Argmax over the whole vocabulary of this TP rank's logits shard [..., V/tp] -> token ids [...].
    Collective over the TP group; `vocab_size` excludes padded vocabulary columns."""
    shards = [torch.empty_like(logits) for _ in range(layout.tp_size)]
    torch.distributed.all_gather(shards, logits.contiguous(), group=layout.tp_group)
    return torch.cat(shards, dim=-1)[..., :vocab_size].argmax(dim=-1)


def greedy_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    layout: ParallelLayout,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    vocab_size: int,
) -> list[list[int]]:
    """Greedy continuation of each prompt, computed with the trainer's own model (no KV cache).

    Meant for small evaluations (the warm-up's accuracy check); rollouts come from SGLang. Every rank
    returns the same tokens: the last stage picks them and broadcasts along the pipeline.
    `vocab_size` excludes padded vocabulary columns from the argmax.
    """
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.full((batch, int(lengths.max()) + max_new_tokens), pad_token_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt)
    finished = torch.zeros(batch, dtype=torch.bool)
    rows = torch.arange(batch)

    def pick_next(mb: MicroBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        last = logits[rows, lengths - 1]  # [batch, V/tp]: only each row's newest position matters
        return (
            last.sum(),
            torch.ones((), dtype=torch.int),
            {"next": vocab_parallel_argmax(last, layout, vocab_size)},
        )

    for _ in range(max_new_tokens):
        window = MicroBatch(tokens=tokens[:, : int(lengths.max())])
        reports = run_schedule(model, [window], pick_next, forward_only=True, with_labels=False)
        next_tokens = reports[0]["next"] if layout.is_last_stage else torch.empty(batch, dtype=torch.long)
        if layout.pp_size > 1:
            torch.distributed.broadcast(next_tokens, src=layout.pp_last_rank, group=layout.pp_group)
        next_tokens = torch.where(finished, pad_token_id, next_tokens)
        tokens[rows, lengths] = next_tokens
        lengths = lengths + (~finished).long()
        finished |= next_tokens == eos_token_id
        if finished.all():
            break
    return [tokens[row, len(prompt) : int(lengths[row])].tolist() for row, prompt in enumerate(prompts)]
