"""The placement by the simulator's step time: re-rank good candidates, then branch and bound.

The exact DP and the ILP minimise the closed-form step time (planner/model/objective.py), a linear proxy;
the plan reports the simulator's (planner/schedule/simulator.py: full-duplex links, message overheads, the
optimizer barrier, the 1F1B cap on micro-batches in flight that makes round trips bind on slow
links). On slow links the two rank placements differently by up to ~25 %, and no linear objective
can follow the simulator's round-trip and barrier terms exactly, so the simulator decides:

1. ``improve``: the closed-form optimum and the heuristic candidates are simulated, then the best
   few are improved by local moves (a cut by one or two nodes, two stages' devices swapped, a stage
   moved to an unused device), each simulated, until no move helps. This gives a good incumbent fast.
2. ``SimulatedSearch``: a depth-first branch and bound over every placement (stage count, device
   class per position, span per stage, the fewest recomputing layers that fit, as objective.evaluate
   picks them), pruned by planner/search/simbound.py's lower bound, which the simulator can never beat:
   a partial pipeline is dropped when its stages' own bound, or the least work the remaining nodes
   need, already reaches the incumbent. Every complete placement whose bound is below the incumbent
   is simulated. When the search finishes, no placement simulates faster than the one returned: the
   proof covers the simulated step. When the deadline stops it, the plan says the search was cut off
   and gives the best lower bound known (the unexplored part's).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np

from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Evaluation, Placement, evaluate
from hetero.planner.model.span_costs import stage_costs
from hetero.planner.schedule.simulator import simulate
from hetero.planner.schedule.step_form import programs_for
from hetero.planner.search.deadline import OutOfTime, check, left
from hetero.planner.search.simbound import lower_bound_s
from hetero.program import Action

# A placement must beat the incumbent by this fraction to replace it (float noise in the simulator).
REL_TOL = 1e-12


@functools.lru_cache(maxsize=64)
def _programs(schedule: str, num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """The schedule's programs (read only: the simulator does not change them)."""
    return programs_for(schedule, num_stages, num_micro_batches)


def simulated_step_s(table: CostTable, ev: Evaluation) -> float:
    """The simulator's step time of a placement: the number the plan reports for it (baselines.predict's)."""
    programs = _programs(table.schedule, len(ev.placement.devices), table.num_micro_batches)
    return simulate(programs, ev.fwd_s, ev.bwd_s, ev.send_s, overhead_s=ev.overhead_s or None,
                    sync_s=ev.sync_s or None, cores=ev.cores).step_time_s


@dataclass
class Scored:
    evaluation: Evaluation
    step_s: float  # simulated


def _neighbours(table: CostTable, p: Placement) -> list[Placement]:
    """Placements one local move away: a cut shifted by 1-2 nodes, two stages' devices swapped, or one
    stage moved to an unused device."""
    out: list[Placement] = []
    spans, devices = list(p.spans), list(p.devices)
    for k in range(len(spans) - 1):
        for delta in (-2, -1, 1, 2):
            cut = spans[k][1] + delta
            if spans[k][0] <= cut < spans[k + 1][1]:
                moved = spans[:k] + [(spans[k][0], cut), (cut + 1, spans[k + 1][1])] + spans[k + 2:]
                out.append(Placement(p.devices, tuple(moved)))
    for a in range(len(devices)):
        for b in range(a + 1, len(devices)):
            swapped = list(devices)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            out.append(Placement(tuple(swapped), p.spans))
        for d in range(table.num_devices):
            if d not in devices:
                out.append(Placement(tuple(devices[:a] + [d] + devices[a + 1:]), p.spans))
    return out


def improve(table: CostTable, candidates: list[Evaluation], num_stages: int | None, deadline: float | None,
            keep: int = 3) -> tuple[Scored | None, int]:
    """The best simulated of ``candidates`` and of local moves from the best ``keep`` of them (until no
    move helps or the deadline); and how many placements were simulated."""
    seen: dict[Placement, float] = {}

    def score(ev: Evaluation) -> float:
        key = Placement(ev.placement.devices, ev.placement.spans)
        if key not in seen:
            seen[key] = simulated_step_s(table, ev)
        return seen[key]

    pool = [ev for ev in candidates if ev.feasible and (not num_stages or len(ev.placement.devices) == num_stages)]
    scored = sorted((Scored(ev, score(ev)) for ev in pool), key=lambda s: s.step_s)
    if not scored:
        return None, len(seen)
    best = scored[0]
    for start in scored[:keep]:
        current = start
        while left(deadline) > 0:
            step = None
            for p in _neighbours(table, current.evaluation.placement):
                if p in seen:
                    continue
                ev = evaluate(table, p)
                if ev.feasible and lower_bound_s(table, ev) < current.step_s:
                    s = score(ev)
                    if s < current.step_s * (1 - REL_TOL) and (step is None or s < step.step_s):
                        step = Scored(ev, s)
                if left(deadline) <= 0:
                    break
            if step is None:
                break
            current = step
        if current.step_s < best.step_s:
            best = current
    return best, len(seen)


@dataclass
class SearchResult:
    best: Scored | None  # the fastest simulated placement known
    proven: bool  # the search finished: no placement simulates faster than ``best`` (or none fits)
    lower_bound_s: float | None  # on every placement's simulated step (= best's when proven)
    nodes: int  # partial pipelines visited
    simulated: int  # complete placements simulated


@dataclass(frozen=True)
class _Partial:
    """A pipeline's first stages: where the next stage starts and what the bound knows so far."""

    stages: tuple[tuple[int, int, int, int], ...]  # (device, first, last, recompute)
    used: tuple[int, ...]  # devices taken per class
    acc: float  # sum of the chosen stages' e_k and 2 c of the links between them
    work: float  # the largest work term A_k + m e_k + T_k of the chosen stages
    finish: float  # the largest sync + optimizer step of the chosen stages


class SimulatedSearch:
    """The branch and bound of the module docstring over one table."""

    def __init__(self, table: CostTable, num_stages: int | None, deadline: float | None) -> None:
        self.table, self.deadline = table, deadline
        n, m = table.num_nodes, table.num_micro_batches
        self.n, self.m = n, m
        classes = table.device_classes()
        self.members = [[d for d, c in enumerate(classes) if c == k] for k in range(max(classes) + 1)]
        self.sizes = [num_stages] if num_stages else list(range(1, min(n, table.num_devices) + 1))
        self.form = table.form
        self.helds = self.form.helds(m, max(self.sizes))
        # slots[p]: the index into helds of what a stage p places from the end holds.
        self.slots = [self.form.slot(p, m, max(self.sizes)) for p in range(max(self.sizes))]
        self.costs = [stage_costs(table, mem[0], self.helds) for mem in self.members]
        # The least compute each node needs anywhere (no recomputation): what the unplaced nodes cost at least.
        least = [min(table.fwd_s[i][d] + table.bwd_s[i][d] for d in range(table.num_devices)) for i in range(n)]
        self.least = np.concatenate([[0.0], np.cumsum(least)]) * (1 - 1e-9)
        # Per device, the most it is faster than ``least`` on any node (<= 1): nodes on it take at least
        # their least time / speed, so r stages do the remaining work no faster than their speeds' sum.
        self.speed = [max([least[i] / t for i in range(n) if (t := table.fwd_s[i][d] + table.bwd_s[i][d]) > 0],
                          default=1.0) for d in range(table.num_devices)]
        self.opt = [np.concatenate([[0.0], np.cumsum([row[d] for row in table.opt_s])]) if table.opt_s else None
                    for d in range(table.num_devices)]
        self._speeds: dict[tuple[tuple[int, ...], int], float] = {}
        self.best: Scored | None = None
        self.open = math.inf  # on OutOfTime: the smallest bound of what was not searched
        self.nodes = self.simulated = 0

    def _stage(self, part: _Partial, size: int, d: int, c: int, first: int, last: int) -> tuple[float, float, float]:
        """(e_k, 2 c_{k-1}, sync + step) of a stage of device d (class c) on nodes first..last at the next position."""
        table, k = self.table, len(part.stages)
        h = self.slots[size - 1 - k]
        fwd, bwd, *_ = self.costs[c]
        e = float(fwd[first, last, h] + bwd[first, last, h])
        link = 0.0
        if k > 0:
            prev, prev_end = part.stages[-1][0], part.stages[-1][2]
            send, recv = table.message_s(prev_end, prev, d)
            e += max(0.0, recv) + max(0.0, send)
            link = 2.0 * table.transfer_s(prev_end, prev, d)
        if k < size - 1:
            send, recv = table.message_s(last, d, d)
            e += max(0.0, send) + max(0.0, recv)
        step = 0.0
        if table.opt_fixed_s:
            opt = self.opt[d]
            step = max(0.0, table.opt_fixed_s[d] + (float(opt[last + 1] - opt[first]) if opt is not None else 0.0))
        sync = table.sync_s(d, part.stages[0][0] if part.stages else d)
        return e, link, sync + step

    def _children(self, part: _Partial, size: int) -> list[tuple[float, _Partial]]:
        """The next stage's choices that fit, with the bound of each (the smallest first)."""
        k, first, n, m = len(part.stages), (part.stages[-1][2] + 1 if part.stages else 0), self.n, self.m
        last_stage = k == size - 1
        out: list[tuple[float, _Partial]] = []
        for c, mem in enumerate(self.members):
            if part.used[c] >= len(mem):
                continue
            d = mem[part.used[c]]
            h = self.slots[size - 1 - k]
            rec = self.costs[c][2]
            for last in ([n - 1] if last_stage else range(first, n - (size - k - 1))):
                if rec[first, last, h] < 0:
                    continue  # does not fit at this position
                e, link, fin = self._stage(part, size, d, c, first, last)
                start = part.acc + link  # A_k + T_k
                work, finish = max(part.work, start + m * e), max(part.finish, fin)
                bound = work
                used = tuple(u + (i == c) for i, u in enumerate(part.used))
                if not last_stage:
                    rest = float(self.least[n] - self.least[last + 1])
                    bound = max(bound, start + e + max(rest, m * rest / self._fastest(used, size - k - 1)))
                child = _Partial(part.stages + ((d, first, last, int(rec[first, last, h])),), used, start + e, work,
                                 finish)
                out.append((bound + finish, child))
        out.sort(key=lambda x: x[0])
        return out

    def _fastest(self, used: tuple[int, ...], count: int) -> float:
        """The sum of the ``count`` largest speeds among the devices not yet used."""
        key = (used, count)
        if key not in self._speeds:
            free = sorted((self.speed[d] for c, mem in enumerate(self.members) for d in mem[used[c]:]), reverse=True)
            self._speeds[key] = max(1e-30, sum(free[:count]))
        return self._speeds[key]

    def _leaf(self, part: _Partial) -> None:
        """Evaluate a complete placement; simulate it if its full bound is below the incumbent."""
        # Recompute and stream: evaluate's rule (objective.stage_choice), which stage_costs computed too.
        placement = Placement(tuple(s[0] for s in part.stages), tuple((s[1], s[2]) for s in part.stages))
        ev = evaluate(self.table, placement)
        if not ev.feasible or (self.best is not None and lower_bound_s(self.table, ev) >= self._cutoff()):
            return
        self.simulated += 1
        step = simulated_step_s(self.table, ev)
        if self.best is None or step < self.best.step_s * (1 - REL_TOL):
            self.best = Scored(ev, step)

    def _cutoff(self) -> float:
        return math.inf if self.best is None else self.best.step_s * (1 - 1e-9)

    def _descend(self, part: _Partial, size: int) -> None:
        """Search below a partial pipeline; on OutOfTime, ``self.open`` gets the bound of what was left."""
        self.nodes += 1
        if len(part.stages) == size:
            self._leaf(part)
            return
        children = self._children(part, size)
        for i, (bound, child) in enumerate(children):
            if bound >= self._cutoff():
                return  # sorted: none of the rest can beat the incumbent either
            try:
                check(self.deadline)
                self._descend(child, size)
            except OutOfTime:
                self.open = min([self.open] + [b for b, _ in children[i:]])
                raise

    def run(self, incumbent: Scored | None) -> SearchResult:
        """Search every stage count; proven when it finishes before the deadline."""
        self.best, self.open = incumbent, math.inf
        root = _Partial((), tuple(0 for _ in self.members), 0.0, 0.0, 0.0)
        for i, size in enumerate(self.sizes):
            try:
                self._descend(root, size)
            except OutOfTime:
                rest, unused = float(self.least[self.n]), tuple(0 for _ in self.members)
                for later in self.sizes[i + 1:]:  # not started: the least work over that many stages
                    self.open = min(self.open, max(rest, self.m * rest / self._fastest(unused, later)))
                low = min(self.open, self.best.step_s) if self.best is not None else self.open
                return SearchResult(self.best, False, None if math.isinf(low) else low, self.nodes, self.simulated)
        optimum = self.best.step_s if self.best is not None else None
        return SearchResult(self.best, True, optimum, self.nodes, self.simulated)


def best_simulated(table: CostTable, candidates: list[Evaluation], num_stages: int | None,
                   deadline: float | None) -> SearchResult:
    """The placement with the smallest simulated step: ``improve`` the candidates, then prove it by the
    branch and bound until ``deadline`` (time.perf_counter())."""
    # Local moves get half the time left: the branch and bound needs the rest to prove (or bound) it. Past the
    # deadline the candidates are still each simulated once: the plan's objective is a simulated step, never the
    # closed form's (a search whose share went to the closed form's solve reported the closed form's step).
    incumbent, simulated = improve(table, candidates, num_stages,
                                   None if deadline is None else time.perf_counter() + left(deadline) / 2)
    search = SimulatedSearch(table, num_stages, deadline)
    result = search.run(incumbent)
    result.simulated += simulated
    return result
