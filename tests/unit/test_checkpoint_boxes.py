"""A rank's shard of a parameter (a range of its flattened elements) as the rectangular chunks the
distributed optimizer's checkpoint stores (`trainer.optimizer.flat_range_boxes`), by hand and exhaustively."""

from __future__ import annotations

import itertools
import math

import pytest

from dapo_megatron.trainer.optimizer import flat_index, flat_range_boxes


def test_a_range_across_rows_is_a_partial_row_whole_rows_and_a_partial_row() -> None:
    # A 3 x 4 tensor, elements 2..9: the rest of row 0, all of row 1, the start of row 2.
    assert flat_range_boxes((3, 4), 2, 10) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 2))]
    assert flat_range_boxes((3, 4), 4, 12) == [((1, 0), (2, 4))]  # whole rows: one box
    assert flat_range_boxes((3, 4), 5, 7) == [((1, 1), (1, 2))]  # inside one row
    assert flat_range_boxes((3, 4), 6, 6) == []
    assert flat_range_boxes((7,), 2, 5) == [((2,), (3,))]


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 6), (4, 1)])
def test_boxes_tile_the_range_in_order_each_one_contiguous(shape: tuple[int, ...]) -> None:
    numel = math.prod(shape)
    for start, end in itertools.combinations_with_replacement(range(numel + 1), 2):
        covered = []
        for corner, size in flat_range_boxes(shape, start, end):
            assert all(c + s <= limit for c, s, limit in zip(corner, size, shape, strict=True))
            elements = sorted(
                flat_index(tuple(c + o for c, o in zip(corner, offsets, strict=True)), shape)
                for offsets in itertools.product(*map(range, size))
            )
            # Contiguous: the box is a view of the flat shard, starting where its corner is.
            first = flat_index(corner, shape)
            assert elements == list(range(first, first + len(elements)))
            covered += elements
        assert covered == list(range(start, end)), (shape, start, end)
