"""A lower bound on every placement's simulated step, for fleets too large to search placement by placement.

The simulated search (planner/search/simsearch.py) proves its placement by bounding partial pipelines; on a rig of
12-16 cards it cannot visit enough of them within the time limit. What it can use instead is the step
form's lower bound (``StepForm.bound``, ``StepForm.suffix``): ``L(P) = base + (m - 1) p(P)`` where ``base``
is the first micro-batch's round trip and ``p`` the largest of the stages' bound weights, the links and the
round trips of each suffix of stages over (m - 1). The simulator never beats L (tests/unit/test_step_form.py checks
``StepForm.least_step`` against it on random pipelines), so its least value over all placements bounds the
simulated optimum from below.

The least L comes from the exact DP (planner/search/exact.py, ``bound=True``): for a threshold t, S(t) is the
least ``base`` of the placements whose every term is at most t. A placement first within the grid point
t_i has p > t_{i-1}, so ``min_i S(t_i) + (m - 1) t_{i-1}`` is a lower bound, within a factor
(1 + GRID_STEP) of the least L for a schedule of one period group (1F1B). Every group shares the grid's
threshold, so a schedule of two (GPipe: forward and backward phases) gets a looser bound, still a bound. S only falls as t rises, so a branch and bound over intervals of the
geometric grid needs a few dozen DPs: an interval where S does not change is settled.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Placement
from hetero.planner.schedule.step_form import linear_step
from hetero.planner.search.deadline import OutOfTime
from hetero.planner.search.exact import ThresholdDP

GRID_STEP = 0.002  # consecutive thresholds 0.2 % apart: the bound is within that of the least L


class _Grid:
    """S(t) on a geometric grid of thresholds, computed on demand."""

    def __init__(self, dp: ThresholdDP, low: float, high: float) -> None:
        self.dp = dp
        count = max(1, math.ceil(math.log(high / low) / math.log1p(GRID_STEP))) + 1
        self.t = low * (1 + GRID_STEP) ** np.arange(count)
        self._sums: dict[int, float] = {}
        self.found: dict[Placement, float] = {}  # each DP's placement, with its bound (L at its own threshold)

    def sum(self, i: int) -> float:
        """S(t_i): the least base among placements whose every term is at most t_i (inf: none)."""
        if i not in self._sums:
            path = self.dp.run(tuple(float(self.t[i]) for _ in self.dp.terms))
            self._sums[i] = math.inf if path is None else path.total_s
            if path is not None:
                placement = self.dp.placement(path)
                value = linear_step(path.total_s, self.dp.m, float(self.t[i]))
                self.found[placement] = min(value, self.found.get(placement, math.inf))
        return self._sums[i]

    def bound(self, a: int, b: int) -> float:
        """The least L of placements first within a threshold of t_a..t_b."""
        below = self.t[a - 1] if a > 0 else self.t[0]
        return linear_step(self.sum(b), self.dp.m, float(below))


@dataclass
class StepBound:
    """What ``least_step_bound`` found: the bound, and the placements its DPs chose (good ones: the least L
    favours placements that simulate fast), best bound first."""

    bound_s: float  # inf: no placement fits
    placements: list[Placement] = field(default_factory=list)


def least_step_bound(table: CostTable, num_stages: int | None = None, deadline: float | None = None,
                     upper_s: float | None = None) -> StepBound | None:
    """A lower bound on the simulated step of every placement (of ``num_stages`` stages, when given); None
    when the DP cannot run on this table (too many device classes) or ran out of time before its first
    answer. Past ``deadline`` the bound covers what was searched (valid, less tight); at ``upper_s`` (a
    known placement's simulated step) it stops refining."""
    dp = ThresholdDP(table, num_stages, deadline, bound=True)
    if dp.too_big():
        return None
    try:
        dp.prepare()
        free = dp.run(tuple(math.inf for _ in dp.terms))  # no threshold: the least base of all
    except OutOfTime:
        return None
    values = np.concatenate([term[np.isfinite(term)].ravel() for term in dp.terms])
    if free is None or not len(values):
        return StepBound(math.inf)  # no placement fits
    # After the barrier every step runs its optimizer: a stage's STEP is max(0, fixed + its nodes' terms), at least
    # the cheapest device's fixed part plus every negative node term it could hold (a profile's fit may have them).
    finish = 0.0
    if table.opt_fixed_s:
        finish = min(max(0.0, fixed + sum(min(0.0, row[d]) for row in table.opt_s))
                     for d, fixed in enumerate(table.opt_fixed_s))
    low = max(float(values.min()), 1e-12)
    # The grid's top: above it, placements are bounded by the free base plus (m - 1) times the top.
    top = max(float(values.max()), (upper_s - free.total_s) / max(dp.m - 1, 1) if upper_s else 0.0, low)
    grid = _Grid(dp, low, top * (1 + GRID_STEP))
    last = len(grid.t) - 1
    tail = linear_step(free.total_s, dp.m, float(grid.t[last]))
    heap: list[tuple[float, int, int]] = [(0.0, 0, last)]
    bound = _search(grid, heap, tail, upper_s - finish if upper_s is not None else None) + finish
    return StepBound(bound, sorted(grid.found, key=grid.found.__getitem__))


def _search(grid: _Grid, heap: list[tuple[float, int, int]], tail: float, upper_s: float | None) -> float:
    """The least bound of the grid's intervals (the module docstring's branch and bound)."""
    low = 0.0  # the popped interval's known bound (it is out of the heap while it is refined)
    try:
        while heap:
            low, a, b = heapq.heappop(heap)
            bound = grid.bound(a, b)
            if bound >= tail or (upper_s is not None and bound >= upper_s):
                return min(bound, tail)
            if a == b or grid.sum(a) == grid.sum(b):
                if not heap or bound <= heap[0][0]:
                    return bound  # settled, and no other interval can go lower
                heapq.heappush(heap, (bound, a, a))  # settled (S is flat, S(a) = S(b)): wait its turn
                continue
            mid = (a + b) // 2
            heapq.heappush(heap, (grid.bound(a, mid), a, mid))
            heapq.heappush(heap, (grid.bound(mid + 1, b), mid + 1, b))
    except OutOfTime:
        return min([low, tail] + [bound for bound, _, _ in heap])
    return tail
