"""Token-budget micro-batches, balanced over data-parallel ranks.

A micro-batch is a rectangle: its rows are right-padded to its longest row, and the model pads that
length on to the multiple sequence parallelism and FP8 need (`models/sequence_padding.py`), so it
costs rows x padded-longest-row tokens of compute and activation memory; the budget counts exactly
those. Rows of one optimizer mini-batch are planned together (all DP ranks hold the whole batch, so
every rank computes the same plan without communicating):

1. Sort the rows by width, longest first, and fill micro-batches greedily while
   rows x first-row-width (padded) <= the budget. Neighbours in the sorted order have similar widths,
   so the padding inside a micro-batch is small, and planning the whole mini-batch at once (not each
   rank's share) makes those neighbours closer still.
2. Halve the costliest micro-batches until their number is a multiple of the DP size.
   Every rank must run the same number of forward passes: megatron-core's FP8 (delayed scaling)
   reduces amaxes over the tensor x data-parallel group in every forward pass, so ranks with fewer
   micro-batches would leave the others waiting in a collective. Halving a sorted micro-batch never
   adds padding. Only when there are fewer rows than passes needed does a rank get an empty
   micro-batch (the actor runs one masked-out token for it).
3. Hand the micro-batches, costliest first, to the rank with the fewest planned tokens among those
   still short of their share (longest-processing-time-first scheduling), so the slowest rank, which
   the gradient all-reduce waits for, does little more than the mean. When each rank gets only a few
   micro-batches that balance is coarse, so step 2 goes on to one more micro-batch per rank as long as
   that takes at least 1% off the busiest rank.

The loss does not care how rows are grouped: each micro-batch returns its loss sum and token count
and megatron-core divides by the global count (see `trainer/forward.py`).

A row's width is the label positions it needs: one past its last response token.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapo_megatron.models.sequence_padding import padded_length

Plan = list[list[list[int]]]
"""[rank][micro-batch] -> row indices into the planned rows."""


def padded_tokens(micro_batch: Sequence[int], widths: Sequence[int], multiple: int = 1) -> int:
    """Tokens computed for `micro_batch` (row indices): its rows x its longest row padded to `multiple`;
    0 when empty."""
    return len(micro_batch) * padded_length(max((widths[row] for row in micro_batch), default=0), multiple)


def fixed_size_plan(rows_per_rank: Sequence[Sequence[int]], micro_batch_size: int) -> Plan:
    """Consecutive micro-batches of `micro_batch_size` rows (the last one shorter) of each rank's rows."""
    return [
        [list(rows[start : start + micro_batch_size]) for start in range(0, len(rows), micro_batch_size)]
        for rows in rows_per_rank
    ]


def token_budget_plan(widths: Sequence[int], *, ranks: int, max_tokens: int, multiple: int = 1) -> Plan:
    """Micro-batches of at most `max_tokens` computed tokens over `widths` (one per row), the same number
    on each of `ranks` ranks, with balanced token counts (see the module docstring). `multiple`: the
    model pads every micro-batch's length to a multiple of this (`models/sequence_padding.py`).

    Raises:
        ValueError: a row, padded, is wider than `max_tokens`, or there are fewer rows than ranks.
    """
    if len(widths) < ranks:
        raise ValueError(f"{len(widths)} rows cannot give each of {ranks} data-parallel ranks a sequence")
    order = sorted(range(len(widths)), key=lambda row: -widths[row])  # stable: equal widths keep batch order
    # What the model computes per row; padding never reorders rows, so `order` is longest first here too.
    computed = [padded_length(width, multiple) for width in widths]
    if computed[order[0]] > max_tokens:
        padding = (
            f" ({computed[order[0]]} as computed: the model pads micro-batches to a multiple of {multiple})"
            if computed[order[0]] != widths[order[0]]
            else ""
        )
        raise ValueError(
            f"a row of {widths[order[0]]} tokens{padding} does not fit the micro-batch budget of "
            f"{max_tokens} tokens (trainer.max_tokens_per_micro_batch)"
        )
    micro: list[list[int]] = []
    for row in order:
        if not micro or (len(micro[-1]) + 1) * computed[micro[-1][0]] > max_tokens:
            micro.append([])
        micro[-1].append(row)

    target = -(-len(micro) // ranks) * ranks
    plan, busiest = _assign(_split(micro, target, computed), computed, ranks)
    # A rank with a few large micro-batches balances coarsely: while one more, smaller, micro-batch per
    # rank takes at least 1% off the busiest rank's tokens (what the step waits for), use it.
    while target + ranks <= len(computed):
        candidate, load = _assign(_split(micro, target + ranks, computed), computed, ranks)
        if load > 0.99 * busiest:
            break
        plan, busiest, target = candidate, load, target + ranks
    return plan


def _split(micro: list[list[int]], count: int, widths: Sequence[int]) -> list[list[int]]:
    """`micro` made `count` micro-batches by halving the costliest one with two rows or more, again and
    again; empty ones make up the count once every micro-batch is down to one row."""
    micro = list(micro)
    while len(micro) < count:
        splittable = [i for i, mb in enumerate(micro) if len(mb) > 1]
        if not splittable:
            return micro + [[] for _ in range(count - len(micro))]
        rows = micro.pop(max(splittable, key=lambda i: padded_tokens(micro[i], widths)))
        micro += [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return micro


def _assign(micro: list[list[int]], widths: Sequence[int], ranks: int) -> tuple[Plan, int]:
    """The same number of micro-batches per rank, costliest first to the least loaded rank with room;
    and the busiest rank's tokens."""
    plan: Plan = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for mb in sorted(micro, key=lambda mb: -padded_tokens(mb, widths)):
        rank = min((r for r in range(ranks) if len(plan[r]) < len(micro) // ranks), key=lambda r: loads[r])
        plan[rank].append(mb)
        loads[rank] += padded_tokens(mb, widths)
    return plan, max(loads)
