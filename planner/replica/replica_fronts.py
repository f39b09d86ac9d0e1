"""Replica pipelines in device classes, and multi-host replicas enumerated into (T, reduction) fronts.

A replica on one host sends every gradient byte from there, so its reduction does not depend on its
split; one over several hosts trades its step time T against its reduction. When such a replica's
placements are few (planner.replicas.ENUMERATE_ROWS), every device order and split of it is scored
here at once (numpy over the splits), for every coordinator candidate, and only the Pareto fronts of
(T, reduction) are kept. See planner/replica/replicas.py for the model and the search that uses them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from hetero.planner.model.cost import CostTable, subtable
from hetero.planner.model.span_costs import SharedCosts, stage_costs
from hetero.planner.schedule.step_form import linear_step
from hetero.planner.search.deadline import check

REL_TOL = 1e-9
INF = math.inf


@dataclass
class ClassPipeline:
    """A replica's pipeline in device classes (stage classes in order, spans) and its T at its share."""

    time_s: float
    classes: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    reduce_s: tuple[float, ...]  # its reduction, per coordinator candidate (FrontEnumerator.coordinators)


@dataclass
class Frontier:
    """An enumerated replica's placements with T <= tau_max: per (coordinator, starts on its host?),
    the Pareto front of (T, reduction), T rising and the reduction strictly falling."""

    least_s: float  # the least T
    fronts: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray, list[ClassPipeline]]] = field(default_factory=dict)

    def at(self, tau: float, hi: int, leads: bool) -> tuple[float, ClassPipeline | None]:
        """The least reduction among placements with T <= tau."""
        times, reds, pipes = self.fronts[(hi, leads)]
        i = int(np.searchsorted(times, tau, side="right")) - 1
        return (float(reds[i]), pipes[i]) if i >= 0 else (INF, None)


def enumeration_rows(counts: tuple[int, ...], num_nodes: int) -> int:
    """(device order, split) rows to enumerate a replica with ``counts`` devices per class: per length s,
    the distinct orders of s of its devices (s! x the x^s coefficient of prod_k sum_{j <= count_k} x^j / j!)
    x the splits."""
    poly = [1.0]
    for count in counts:
        poly = [sum(poly[s - j] / math.factorial(j) for j in range(min(count, s) + 1) if s - j < len(poly))
                for s in range(len(poly) + count)]
    return int(sum(math.factorial(s) * poly[s] * math.comb(num_nodes - 1, s - 1)
                   for s in range(1, min(len(poly) - 1, num_nodes) + 1)))


def class_sequences(counts: tuple[int, ...], length: int) -> list[tuple[int, ...]]:
    """Every order of ``length`` classes from a multiset: the stage classes of a pipeline on it."""
    items = [k for k, x in enumerate(counts) for _ in range(x)]
    return sorted(set(itertools.permutations(items, length)))


class FrontEnumerator:
    """Enumerates replicas over several hosts at a share, with each class's stage costs cached."""

    def __init__(self, table: CostTable, members: list[list[int]], coordinators: list[int],
                 num_stages: int | None, deadline: float, shared: SharedCosts | None = None) -> None:
        self.table, self.members, self.coordinators, self.shared = table, members, coordinators, shared
        self.num_stages, self.deadline = num_stages, deadline
        self.host = [table.host_of[mem[0]] for mem in members]  # per class
        self._tables: dict[int, CostTable] = {}
        self._costs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def table_for(self, m: int) -> CostTable:
        """The fleet's table with m micro-batches per step."""
        if m not in self._tables:
            self._tables[m] = subtable(self.table, m)
        return self._tables[m]

    def stage_arrays(self, k: int, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Class k's [first][last][held - 1] forward and backward seconds at share m (gpipe: held = m only)."""
        if (k, m) not in self._costs:
            table = self.table_for(m)
            helds = table.form.helds(m, table.num_devices)
            fwd, bwd, *_ = stage_costs(table, self.members[k][0], helds, self.shared)
            self._costs[(k, m)] = (fwd, bwd)
        return self._costs[(k, m)]

    def enumerate(self, counts: tuple[int, ...], m: int, tau_max: float) -> Frontier | None:
        """Every placement on the multiset's devices at share m with T <= tau_max, as (T, reduction) fronts."""
        table, n, form = self.table_for(m), self.table.num_nodes, self.table.form
        grad = np.concatenate([[0.0], np.cumsum(table.grad_bytes)])
        per_class = np.array([[table.reduce_s_per_byte[h][c] for c in self.coordinators] for h in self.host])
        times, reds, parts = [], [], []
        size = sum(counts)
        lengths = [self.num_stages] if self.num_stages else range(1, min(size, n) + 1)
        for seq in (q for s in lengths if s <= min(size, n) for q in class_sequences(counts, s)):
            check(self.deadline)
            s = len(seq)
            combos = list(itertools.combinations(range(1, n), s - 1))
            cuts = np.array(combos, dtype=np.int64).reshape(len(combos), s - 1)
            bounds = np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts, np.full((len(cuts), 1), n)], axis=1)
            total = np.zeros(len(cuts))
            periods = [np.zeros(len(cuts)) for _ in form.groups]  # the step form's bottlenecks
            red = np.zeros((len(cuts), len(self.coordinators)))
            for k, c in enumerate(seq):
                first, last = bounds[:, k], bounds[:, k + 1] - 1
                fwd, bwd = self.stage_arrays(c, m)
                h = form.slot(s - 1 - k, m, table.num_devices)
                f, b = fwd[first, last, h], bwd[first, last, h]
                total += f + b
                periods = [np.maximum(p, g.stage(f, b)) for p, g in zip(periods, form.groups, strict=True)]
                red += (grad[last + 1] - grad[first])[:, None] * per_class[c][None, :]
                if k < s - 1:
                    a, z = self.members[c][0], self.members[seq[k + 1]][0]
                    link = np.array([table.transfer_s(e, a, z) for e in range(n)])[last]
                    total += 2.0 * link
                    periods = [np.maximum(p, g.link * link) for p, g in zip(periods, form.groups, strict=True)]
            ok = np.isfinite(total)
            step = np.where(ok, linear_step(total, m, np.where(ok, sum(periods), 0.0)), INF)
            keep = step <= tau_max * (1 + REL_TOL)
            times.append(step[keep])
            reds.append(red[keep])
            parts.append((seq, bounds[keep]))
        time_s = np.concatenate(times)
        if not len(time_s):
            return None
        return self._fronts(time_s, np.concatenate(reds), parts)

    def _fronts(self, time_s: np.ndarray, reds: np.ndarray,
                parts: list[tuple[tuple[int, ...], np.ndarray]]) -> Frontier:
        """Per coordinator candidate, with and without leading: the Pareto front of (T, reduction)."""
        part = np.concatenate([np.full(len(b), j) for j, (_, b) in enumerate(parts)])
        row = np.concatenate([np.arange(len(b)) for _, b in parts])
        leads = np.array([self.host[parts[j][0][0]] for j in part])
        order = np.argsort(time_s, kind="stable")
        frontier = Frontier(float(time_s[order[0]]))
        for hi, h in enumerate(self.coordinators):
            for lead in (False, True):
                idx = order[leads[order] == h] if lead else order
                red = reds[idx, hi]
                before = np.concatenate([[INF], np.minimum.accumulate(red)[:-1]])
                idx = idx[red < before]  # strictly below every faster placement's
                pipes = []
                for i in idx:
                    seq, bounds = parts[part[i]]
                    r = bounds[row[i]]
                    spans = tuple((int(r[k]), int(r[k + 1]) - 1) for k in range(len(seq)))
                    pipes.append(ClassPipeline(float(time_s[i]), seq, spans, tuple(float(x) for x in reds[i])))
                frontier.fronts[(hi, lead)] = (time_s[idx], reds[idx, hi], pipes)
        return frontier
