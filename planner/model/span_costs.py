"""A stage's costs on one device for every span of nodes: what the exact DP, the simulated search and the replica
fronts price stages from.

For device d and every span first..last of the layer graph: forward and backward seconds, and the fewest
recomputing and streamed layers that fit d's memory while the stage holds a given number of micro-batches
(objective.stage_choice's pair of least added time, under the table's planner.recompute and planner.offload),
computed for all spans at once as numpy arrays and equal, term by term, to what objective.evaluate computes.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from hetero.planner.model.cost import CostTable
from hetero.planner.model.stream_costs import BUFFER_LAYERS


def _column(rows: list[list[float]], d: int) -> np.ndarray:
    return np.array([r[d] for r in rows], dtype=float)


class _Spans:
    """Device d's per-span sums, [first][last] (nan/-inf where last < first), in evaluate's order."""

    def __init__(self, table: CostTable, d: int) -> None:
        n = table.num_nodes
        fw, bw = _column(table.fwd_s, d), _column(table.bwd_s, d)
        wt, lr = _column(table.weights, d), _column(table.lora, d)
        can = np.array(table.recomputable, dtype=bool)
        acts_prefix, rank_prefix, self.saved_prefix = (np.array(a) for a in table.prefixes(d))
        self.fwd, self.bwd, weights, lora = (np.full((n, n), np.nan) for _ in range(4))
        # The largest recomputable layer's activations in the span (what re-runs at once).
        self.working = np.full((n, n), -np.inf)
        act_or_low = np.where(can, _column(table.activations_per_mb, d), -np.inf)
        for length in range(n):  # sums from the span's first node on, as sum() in evaluate adds them
            j = np.arange(n - length)
            e = j + length
            if length == 0:
                self.fwd[j, e], self.bwd[j, e], weights[j, e], lora[j, e] = fw[e], bw[e], wt[e], lr[e]
                self.working[j, e] = act_or_low[e]
            else:
                self.fwd[j, e] = self.fwd[j, e - 1] + fw[e]
                self.bwd[j, e] = self.bwd[j, e - 1] + bw[e]
                weights[j, e] = weights[j, e - 1] + wt[e]
                lora[j, e] = lora[j, e - 1] + lr[e]
                self.working[j, e] = np.maximum(self.working[j, e - 1], act_or_low[e])
        first, last = np.arange(n)[:, None], np.arange(n)[None, :]
        self.span = last >= first
        self.total = acts_prefix[last + 1] - acts_prefix[first]
        self.count = np.where(self.span, rank_prefix[last + 1] - rank_prefix[first], 0)  # recomputable layers
        self.rank = np.broadcast_to(rank_prefix[:n][:, None], (n, n))
        self.fixed = weights + lora
        self.weights, self.lora = weights, lora
        self.usable, self.workspace = table.usable_bytes[d], table.workspace_bytes
        # extra[k][r]: backward seconds the r recomputable nodes from the k-th one on add, in order.
        rs = np.array([table.recompute_s[i][d] for i in range(n) if table.recomputable[i]], dtype=float)
        self.extra = np.full((len(rs) + 1, len(rs) + 1), np.nan)
        self.extra[:, 0] = 0.0
        for r in range(1, len(rs) + 1):
            ks = np.arange(len(rs) - r + 1)
            self.extra[ks, r] = self.extra[ks, r - 1] + rs[ks + r - 1]

    def fits(self, held: float, r: np.ndarray, fixed: np.ndarray | None = None) -> np.ndarray:
        """objective.stage_fits of every span holding ``held`` micro-batches with ``r`` recomputing
        (``fixed``: resident weights + LoRA, default the span's own)."""
        r = np.clip(r, 0, self.count)
        top = len(self.saved_prefix) - 1
        saved = self.saved_prefix[np.minimum(self.rank + r, top)] - self.saved_prefix[np.minimum(self.rank, top)]
        acts = np.where(r > 0, held * (self.total - saved) + self.working, held * self.total)
        return self.span & ((self.fixed if fixed is None else fixed) + acts + self.workspace <= self.usable)

    def fewest_recompute(self, held: float, mode: str, fixed: np.ndarray | None = None) -> np.ndarray:
        """objective.stage_recompute for every span: the fewest recomputing layers that fit; -1: none."""
        count = self.count
        none_fit = self.fits(held, np.zeros_like(count), fixed)
        all_fit = self.fits(held, count, fixed) & (count > 0)
        if mode == "none":
            return np.where(none_fit, 0, -1)
        if mode == "full":
            return np.where(count > 0, np.where(all_fit, count, -1), np.where(none_fit, 0, -1))
        # From one layer on, memory only falls as more recompute: bisect for the fewest that fit.
        lo, hi = np.ones_like(count), count.copy()
        active = all_fit & ~none_fit
        while True:
            todo = active & (lo < hi)
            if not todo.any():
                break
            mid = (lo + hi) // 2
            ok = self.fits(held, mid, fixed)
            hi = np.where(todo & ok, mid, hi)
            lo = np.where(todo & ~ok, mid + 1, lo)
        return np.where(none_fit, 0, np.where(active, hi, -1))


@dataclass
class SharedCosts:
    """Stage cost arrays shared by the solves of one search on sub-fleets of one table (the replica search): per
    (device key, held micro-batches), so a class's arrays are built once, not once per sub-fleet and share."""

    keys: list[Hashable]  # per device of the table being solved: its key (its class in the whole fleet's table)
    store: dict[tuple[Hashable, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict)


def stage_costs(table: CostTable, d: int, helds: list[int], shared: SharedCosts | None = None,
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Device d running nodes first..last holding ``helds[h]`` micro-batches: [first][last][h] arrays of
    forward seconds, backward seconds (with the extra forward of its recomputing layers and the copies of
    its streamed ones), how many recompute and how many stream (objective.stage_choice: the pair of least
    added time that fits under the table's modes; -1 and inf times where none fits).

    Sums run from ``first`` in node order and memory follows objective.stage_activations / stage_fits
    term by term, so every number equals what objective.evaluate computes for that stage. ``shared``: arrays
    already built for d's key are taken from it, and new ones are kept there."""
    store = {} if shared is None else shared.store
    key = d if shared is None else shared.keys[d]
    todo = [held for held in dict.fromkeys(helds) if (key, held) not in store]
    if todo:
        spans = _Spans(table, d)
        streams = _StreamSpans(table, d, spans)
        for held in todo:
            store[(key, held)] = _held_costs(table, spans, streams, held)
    parts = [store[(key, held)] for held in helds]
    return tuple(np.stack([p[i] for p in parts], axis=-1) for i in range(4))  # type: ignore[return-value]


def _held_costs(table: CostTable, spans: _Spans, streams: _StreamSpans, held: int,
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """stage_costs for one held count: [first][last] forward and backward seconds, recompute and stream counts."""
    n = table.num_nodes
    fwd, bwd = np.full((n, n), np.inf), np.full((n, n), np.inf)
    rec, stream = np.full((n, n), -1, dtype=np.int64), np.full((n, n), -1, dtype=np.int64)
    top = len(spans.extra) - 1
    best = np.full((n, n), np.inf)
    for s in streams.choices():
        valid, streamed, sf = streams.terms(s)
        fixed = np.where(s > 0, (spans.weights - streamed + min(s, BUFFER_LAYERS) * streams.buffer), spans.weights)
        r = np.where(valid, spans.fewest_recompute(float(held), table.recompute_mode, fixed + spans.lora), -1)
        good = r >= 0
        extra = np.where(r > 0, spans.extra[np.minimum(spans.rank, top), np.clip(r, 0, top)], 0.0)
        better = good & ((extra + sf) + sf < best)
        best = np.where(better, (extra + sf) + sf, best)
        fwd = np.where(better, spans.fwd + sf, fwd)
        bwd = np.where(better, spans.bwd + extra + sf, bwd)
        rec = np.where(better, r, rec)
        stream = np.where(better, s, stream)
    return fwd, bwd, rec, stream


class _StreamSpans:
    """Device d's streaming terms for every span, as objective.stream_terms computes them."""

    def __init__(self, table: CostTable, d: int, spans: _Spans) -> None:
        srank, sbytes, sfetch = (np.array(a) for a in table.stream_prefixes(d))
        n = table.num_nodes
        first, last = np.arange(n)[:, None], np.arange(n)[None, :]
        self.end = np.broadcast_to(srank[last + 1], (n, n))
        self.count = np.where(spans.span, srank[last + 1] - srank[first], 0)
        self.sbytes, self.sfetch = sbytes.astype(float), sfetch.astype(float)
        self.start, self.buffer = table.stream_start_s[d], table.stream_buffer[d]
        self.most = max(table.stream_choices(d, 0, n - 1))
        self.mode = table.stream_mode if table.can_stream[d] else "none"

    def choices(self) -> range:
        return range(1) if self.mode == "none" else range(self.most + 1)

    def terms(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(spans where s is allowed, bytes kept in host RAM, forward seconds) with the last s streaming."""
        if s == 0:
            valid = (self.count == 0) if self.mode == "full" else np.ones_like(self.count, dtype=bool)
            return valid, np.zeros(self.count.shape), np.zeros(self.count.shape)
        valid = (self.count == s) if self.mode == "full" else (self.count >= s)
        e = self.end
        lo = np.maximum(e - s, 0)
        return valid, self.sbytes[e] - self.sbytes[lo], (self.sfetch[e] - self.sfetch[lo]) + self.start
