"""Packing records into fixed-length rows (torch-free: the runtime's batches and `hetero compile`'s data lines).

A step's rows are ``[micro_batch_size, seq_len]`` token arrays. Packed, a row holds several records back to back
(attention never crosses a record's boundary: runtime/stage/attention.py); the rest of the row is padding.
Records are placed by best-fit decreasing: the longest first, each into the fullest row it still fits, so the
rows an epoch needs depend only on the multiset of lengths, never on their order. That keeps the number of rows per
epoch the same in every epoch (a step's rows are a pure function of the step number: docs/data.md).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: positions into ``lengths`` grouped into rows whose lengths (each clipped to
    ``capacity``) sum to at most ``capacity``; a row keeps its records in the order they were placed. Ties in
    length keep the order of ``lengths``, so the result is deterministic."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: -min(int(lengths[i]), capacity))
    rows: list[list[int]] = []
    # Rows with room left, as (room, row index), sorted: the best fit is the first with room >= length.
    open_rows: list[tuple[int, int]] = []
    for i in order:
        need = max(1, min(int(lengths[i]), capacity))
        at = bisect.bisect_left(open_rows, (need, -1))
        if at < len(open_rows):
            room, row = open_rows.pop(at)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        room -= need
        if room > 0:
            bisect.insort(open_rows, (room, row))
    return rows


def steps_for_epochs(epochs: int, rows_per_epoch: int, rows_per_step: int) -> int:
    """Optimizer steps that train ``epochs`` passes over the data: steps run on across epochs (a step may hold the
    end of one epoch and the start of the next), so this is ceil(epochs x rows / rows per step), not epochs x the
    steps of one epoch."""
    return max(1, math.ceil(epochs * rows_per_epoch / max(rows_per_step, 1)))


@dataclass(frozen=True)
class LengthStats:
    """What a data set's token lengths mean for a run at ``seq_len`` (printed by `hetero compile`)."""

    records: int  # records measured (all, or a sample of a big file)
    total_records: int  # records in the file
    median: int
    p95: int
    longest: int
    seq_len: int
    truncated: int  # measured records longer than seq_len
    packed: bool
    rows: int  # rows one epoch of the measured records takes
    efficiency: float  # real (non-pad) tokens / computed tokens, packed or one record per row
    label_fraction: float  # label tokens / computed tokens (what a step trains of what it computes)
    # The sequence length whose causal attention does the work the rows do: attention stays inside each record
    # packed, so a token attends (its position in the record + 1) keys; a row of one record (no mask) attends over
    # the whole row. (attention_len + 1) / 2 is the mean keys per computed token.
    attention_len: float = 0.0

    @property
    def rows_per_epoch(self) -> int:
        """Rows of the whole file (scaled from the sample)."""
        return math.ceil(self.rows * self.total_records / max(self.records, 1))

    def suggested_seq_len(self) -> int:
        """The shortest seq_len that truncates no measured record: the longest, rounded up to a multiple of 64
        (never above seq_len)."""
        return min(self.seq_len, max(64, 64 * math.ceil(self.longest / 64)))


def length_stats(lengths: Sequence[int], label_counts: Sequence[int], seq_len: int, packed: bool,
                 total_records: int | None = None) -> LengthStats:
    """Statistics of token ``lengths`` (with each record's label-token count) at ``seq_len``."""
    if not lengths:
        raise ValueError("no records")
    clipped = [min(int(n), seq_len) for n in lengths]
    ordered = sorted(int(n) for n in lengths)

    def pct(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    if packed:
        packed_rows = pack_rows(clipped, seq_len)
        rows = len(packed_rows)
        pads = [seq_len - sum(clipped[i] for i in row) for row in packed_rows]  # a segment of its own each
        keys = sum(n * (n + 1) / 2 for n in clipped) + sum(p * (p + 1) / 2 for p in pads)
    else:
        rows = len(clipped)
        keys = rows * seq_len * (seq_len + 1) / 2
    computed = rows * seq_len
    labels = sum(min(int(c), n) for c, n in zip(label_counts, clipped, strict=True))
    return LengthStats(records=len(lengths), total_records=total_records or len(lengths), median=pct(0.5),
                       p95=pct(0.95), longest=ordered[-1], seq_len=seq_len,
                       truncated=sum(1 for n in lengths if n > seq_len), packed=packed, rows=rows,
                       efficiency=sum(clipped) / computed, label_fraction=labels / computed,
                       attention_len=2 * keys / computed - 1)
