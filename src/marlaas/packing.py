"""Batches of rows padded to their longest row, with the padding bounded.

The rollout engine's prefill forwards and the trainer's micro-batches both pad their
rows to the longest one. `pack_longest_first` cuts lengths sorted longest first into
consecutive batches in which no row is shorter than `MIN_FILL` of the batch's first
(longest) row, so at most a quarter of a batch is padding, whatever the mix of
lengths; `max_tokens` also bounds rows x length.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

#: Least length of a row, relative to the longest row of its batch.
MIN_FILL = 0.75


def pack_longest_first(
    lengths: Sequence[int], max_tokens: int | None = None
) -> list[tuple[int, int]]:
    """The `[start, end)` spans of the batches over `lengths` (non-increasing, each at
    least 1); `ValueError` for a row longer than `max_tokens`."""
    neg_lengths = [-n for n in lengths]  # ascending, for bisect
    spans: list[tuple[int, int]] = []
    start = 0
    while start < len(lengths):
        length = lengths[start]
        end = len(lengths)
        if max_tokens is not None:
            if length > max_tokens:
                raise ValueError(f"a row of {length} tokens exceeds the budget of {max_tokens}")
            end = min(end, start + max_tokens // length)
        end = bisect.bisect_right(neg_lengths, -math.ceil(MIN_FILL * length), start + 1, end)
        spans.append((start, end))
        start = end
    return spans
