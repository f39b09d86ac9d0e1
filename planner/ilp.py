"""The placement ILP (PuLP + CBC): one path with side constraints through a layered network.

A placement is a path through planner/network.py's network: each arc is one stage (device d runs
nodes i..j) or one link, so stage times, link times and memory are precomputed per arc and the LP
relaxation is a flow (tight), not big-M positions and orders. Memory needs no rows (arcs that do
not fit are never created; a flat network adds one row per cut for micro-batches in flight).

- Flow conservation from the source (a stage starting at node 0) to the sink (one ending last).
- Each device runs at most one stage, so per-device sums of arc times bound the period (the max
  term of the objective); so do the links at each cut and the stages covering each node.
- Identical devices (equal cost-table columns, same host) are used in index order.
- A MIP start from the best known placement (the baselines and the split DP of planner/splits.py)
  also prunes arcs that cannot beat it.

The objective is hetero.planner.objective.pipeline_step_time in these variables (tests check it
against brute force). CBC's status is checked; a time-limited run reports its gap.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

import pulp

from hetero.plan import SolverReport
from hetero.planner.cost import CostTable
from hetero.planner.network import (
    LinkArc,
    Network,
    StageArc,
    build_network,
    canonical,
    head_state,
    tail_state,
)
from hetero.planner.objective import Evaluation, Placement, evaluate
from hetero.planner.splits import dp_starts

__all__ = ["IlpResult", "build_network", "canonical", "solve_ilp"]


@dataclass
class IlpResult:
    evaluation: Evaluation | None  # None when infeasible or no solution within the time limit
    report: SolverReport


def _parse_cbc_log(text: str) -> tuple[float | None, float | None]:
    """(best objective, best bound) from a CBC log when it stopped early; (None, None) otherwise."""
    m = re.search(r"best objective ([-\d.eE+]+)\s*\(best possible ([-\d.eE+]+)\)", text)
    if m:
        return float(m.group(1)), float(m.group(2))
    return None, None


def _best_start(table: CostTable, num_stages: int | None, starts: list[Placement] | None) -> Evaluation | None:
    """The fastest feasible candidate placement with the requested number of stages."""
    best: Evaluation | None = None
    for cand in starts or []:
        ev = evaluate(table, cand)
        if ev.feasible and (not num_stages or len(cand.devices) == num_stages):
            if best is None or ev.step_time_s < best.step_time_s:
                best = ev
    return best


def _expr(terms: object) -> pulp.LpAffineExpression:
    """A linear expression from (variable, coefficient) pairs (much faster than lpSum of products)."""
    return pulp.LpAffineExpression(list(terms))  # type: ignore[call-overload]


class _Model:
    """The PuLP problem over a Network, and how to read a placement back out of it."""

    def __init__(self, table: CostTable, net: Network, num_stages: int | None) -> None:
        n, m = table.num_nodes, table.num_micro_batches
        gpipe = table.schedule == "gpipe"
        self.table, self.net = table, net
        prob = pulp.LpProblem("hetero_placement", pulp.LpMinimize)
        self.y = {a: pulp.LpVariable(f"y{k}", cat="Binary") for k, a in enumerate(net.stages)}
        # Links and the leave-the-cap arcs are integral once the stages are: continuous suffices.
        self.z = {a: pulp.LpVariable(f"z{k}", 0, 1) for k, a in enumerate(net.links)}
        self.down: dict[tuple[int, int], pulp.LpVariable] = {}
        inflow: dict = defaultdict(list)  # type: ignore[type-arg]
        outflow: dict = defaultdict(list)  # type: ignore[type-arg]
        first = []
        for a, var in self.y.items():
            tail = tail_state(table, net, a)
            if tail is None:
                first.append(var)
            else:
                outflow[tail].append(var)
            head = head_state(table, net, a)
            if head is not None:
                inflow[head].append(var)
        for a, var in self.z.items():
            outflow[("A", a.cut, a.state, a.group)].append(var)
            inflow[("B", a.cut, a.state, a.host)].append(var)
        if net.cap > 1:
            for key in [k for k in inflow if k[0] == "A" and k[2] == net.cap]:
                var = pulp.LpVariable(f"down_{key[1]}_{key[3]}", 0, 1)
                self.down[key[1], key[3]] = var
                outflow[key].append(var)
                inflow[("A", key[1], net.cap - 1, key[3])].append(var)
        prob += pulp.lpSum(first) == 1, "source"
        for state in set(inflow) | set(outflow):
            prob += pulp.lpSum(inflow[state]) == pulp.lpSum(outflow[state])
        by_device: dict[int, list[StageArc]] = defaultdict(list)
        for a in net.stages:
            by_device[a.device].append(a)
        used = {d: pulp.lpSum(self.y[a] for a in arcs) for d, arcs in by_device.items()}
        for u in used.values():
            prob += u <= 1
        if num_stages:
            prob += pulp.lpSum(self.y.values()) == num_stages
        for a, b in net.twins:  # b only after a, and only if a is used
            if b not in used:
                continue  # no arc left for b: nothing to order
            ua, ub = used.get(a, 0), used[b]
            prob += ub <= ua
            pos_a = pulp.lpSum(arc.first * self.y[arc] for arc in by_device.get(a, []))
            pos_b = pulp.lpSum(arc.first * self.y[arc] for arc in by_device.get(b, []))
            prob += pos_a + ub <= pos_b + n * (1 - ub)

        self.after: dict[int, pulp.LpVariable] = {}
        if net.flat:
            self._in_flight_rows(prob)

        # The max terms, bounded by every set of arcs of which at most one (unit) is used: the
        # arcs of one device, the links at one cut, and the arcs covering one node. The last is
        # written as a running sum (plus arcs starting at node k, minus arcs ending at k-1) so each
        # arc appears twice, not once per node it covers.
        starting: dict[int, list[StageArc]] = defaultdict(list)
        ending: dict[int, list[StageArc]] = defaultdict(list)
        for a in net.stages:
            starting[a.first].append(a)
            ending[a.last].append(a)
        links_at: dict[int, list[LinkArc]] = defaultdict(list)
        for a in net.links:
            links_at[a.cut].append(a)
        if gpipe:
            self.periods = [pulp.LpVariable("period_fwd", 0), pulp.LpVariable("period_bwd", 0)]
            weights = [lambda a: a.fwd, lambda a: a.bwd]
            link_factor = 1.0
        else:
            self.periods = [pulp.LpVariable("period", 0)]
            weights = [lambda a: a.fwd + a.bwd]
            link_factor = 2.0
        self.covers: list[tuple[list[pulp.LpVariable], object]] = []
        for p, (period, weight) in enumerate(zip(self.periods, weights, strict=True)):
            for arcs in by_device.values():
                prob += _expr((self.y[a], weight(a)) for a in arcs) <= period
            for arcs in links_at.values():
                prob += _expr((self.z[a], link_factor * a.time) for a in arcs) <= period
            prev: pulp.LpVariable | None = None
            self.covers.append(([], weight))
            for k in range(n):
                cover = pulp.LpVariable(f"cover{p}_{k}", 0)
                terms = [(self.y[a], weight(a)) for a in starting[k]]
                terms += [(self.y[a], -weight(a)) for a in ending[k - 1]] if k else []
                terms += [(prev, 1.0)] if prev is not None else []
                prob += _expr(terms) == cover
                prob += cover <= period
                self.covers[-1][0].append(cover)
                prev = cover
        prob += (_expr((v, a.fwd + a.bwd) for a, v in self.y.items())
                 + _expr((v, 2.0 * a.time) for a, v in self.z.items())
                 + (m - 1) * pulp.lpSum(self.periods))
        self.prob = prob

    def _in_flight_rows(self, prob: pulp.LpProblem) -> None:
        """Flat network: a stage that fits holding h micro-batches has at most h - 1 stages after it."""
        n, net = self.table.num_nodes, self.net
        starting: dict[int, list[StageArc]] = defaultdict(list)
        limited: dict[int, list[StageArc]] = defaultdict(list)
        for a in net.stages:
            starting[a.first].append(a)
            if a.held < net.most_held and a.last < n - 1:
                limited[a.last].append(a)
        if not limited:
            return
        nxt: pulp.LpVariable | None = None
        for j in range(n - 2, -1, -1):  # after[j]: stages starting after node j, summed from the end
            var = pulp.LpVariable(f"after_{j}", 0)
            prob += _expr([(self.y[b], 1.0) for b in starting[j + 1]] + ([(nxt, 1.0)] if nxt is not None else [])) == var
            self.after[j] = var
            nxt = var
        top = net.most_stages - 1
        for j, arcs in limited.items():
            # At most one stage ends at node j: if it is arc a, after[j] <= a.held - 1; else <= top.
            prob += self.after[j] + _expr((self.y[a], top - (a.held - 1)) for a in arcs) <= top

    def warm_start(self, ev: Evaluation) -> bool:
        """Set every variable to the placement ``ev``; False if one of its arcs was pruned."""
        table, net = self.table, self.net
        pl = ev.placement
        num = len(pl.devices)
        gpipe = table.schedule == "gpipe"
        chosen: set[tuple[int, int, int, int, int]] = set()
        links: set[tuple[int, int, int, str]] = set()
        downs: set[tuple[int, int]] = set()
        for k, (d, (a, b)) in enumerate(zip(pl.devices, pl.spans, strict=True)):
            q = 1 if gpipe else min(num - k, net.cap)
            chosen.add((d, a, b, q, ev.recompute[k] if ev.recompute else 0))
            if k > 0:
                prev = pl.devices[k - 1]
                links.add((a, q, net.group_of[prev], table.devices[d].host))
                if not gpipe and q < net.cap and min(num - k + 1, net.cap) == net.cap:
                    downs.add((a, net.group_of[prev]))
        ys = {(a.device, a.first, a.last, a.state, a.recompute): v for a, v in self.y.items()}
        zs = {(a.cut, a.state, a.group, a.host): v for a, v in self.z.items()}
        if not chosen <= set(ys) or not links <= set(zs) or not downs <= set(self.down):
            return False
        for key, v in ys.items():
            v.setInitialValue(1 if key in chosen else 0)
        for lkey, v in zs.items():
            v.setInitialValue(1 if lkey in links else 0)
        for down, v in self.down.items():
            v.setInitialValue(1 if down in downs else 0)
        for j, var in self.after.items():
            var.setInitialValue(sum(1 for a, _ in pl.spans if a > j))
        for covers, weight in self.covers:
            for a in self.y:
                if (a.device, a.first, a.last, a.state, a.recompute) in chosen:
                    for k in range(a.first, a.last + 1):
                        covers[k].setInitialValue(weight(a))  # type: ignore[operator]
        link_times = [0.0] + [s / net.unit for s in ev.send_s[:-1]]
        if gpipe:
            self.periods[0].setInitialValue(max(f / net.unit for f in ev.fwd_s + link_times))
            self.periods[1].setInitialValue(max(b / net.unit for b in ev.bwd_s + link_times))
        else:
            stage = [(f + b) / net.unit for f, b in zip(ev.fwd_s, ev.bwd_s, strict=True)]
            self.periods[0].setInitialValue(max(stage + [2 * c for c in link_times]))
        return True

    def extract(self) -> Evaluation:
        """Read the placement out of the solved variables (rounded: CBC returns floats)."""
        arcs = sorted((a for a, v in self.y.items() if (v.varValue or 0.0) > 0.5), key=lambda a: a.first)
        return evaluate(self.table, Placement(tuple(a.device for a in arcs), tuple((a.first, a.last) for a in arcs),
                                              tuple(a.recompute for a in arcs)))


def solve_ilp(
    table: CostTable,
    num_stages: int | None = None,
    time_limit_s: float = 30.0,
    starts: list[Placement] | None = None,
    split_dp: bool = True,
    layered: bool | None = None,
) -> IlpResult:
    """Minimize the closed-form step time over placements; the report says how sure the solver is.

    ``starts``: candidate placements (baselines); with ``split_dp`` also the split DP's placements
    (planner/splits.py). The best feasible one bounds the search (arcs that cannot beat it are
    pruned), seeds CBC (MIP start) and is returned if CBC finds nothing better. ``layered``: see
    build_network (None: automatic).
    """
    t0 = time.perf_counter()
    start = _best_start(table, num_stages, starts)
    if split_dp:
        found = dp_starts(table, num_stages)
        if found and (start is None or found[0].step_time_s < start.step_time_s):
            start = found[0]
    net = build_network(table, num_stages, start.step_time_s if start is not None else None, layered)
    model = _Model(table, net, num_stages)
    prob = model.prob
    if start is not None:
        start = evaluate(table, canonical(start.placement, net.twins))  # same costs: twins are identical
    warm = start is not None and model.warm_start(start)
    fd, log_path = tempfile.mkstemp(prefix="hetero_cbc_", suffix=".log")
    os.close(fd)
    try:
        # One thread: the machine is shared, and CBC's parallel tree search pays off only on big trees.
        # CBC gets what is left of the budget after building the network and the model.
        left = max(1.0, time_limit_s - (time.perf_counter() - t0))
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=left, logPath=log_path, gapRel=1e-9,
                                   warmStart=warm, threads=1)
        prob.solve(solver)
        with open(log_path, errors="replace") as fh:
            log_text = fh.read()
    finally:
        os.unlink(log_path)
    elapsed = time.perf_counter() - t0

    status = pulp.LpStatus[prob.status]
    sol_status = pulp.LpSolution.get(prob.sol_status, str(prob.sol_status))
    has_solution = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    evaluation = None
    objective = None
    gap: float | None = None
    proven = prob.sol_status == pulp.LpSolutionOptimal
    message = ""
    if has_solution:
        evaluation = model.extract()
        objective = pulp.value(prob.objective) * net.unit
        if start is not None and start.step_time_s < evaluation.step_time_s:
            evaluation, objective = start, start.step_time_s
        if not proven:
            message = f"time limit of {time_limit_s:g} s reached before optimality was proven"
    elif start is not None:
        # The start's arcs are in the network, so CBC can only have run out of time.
        evaluation, objective = start, start.step_time_s
        message = f"no better placement found within {time_limit_s:g} s: kept the best heuristic placement"
    elif prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        message = "no placement satisfies the memory limits"
    else:
        message = f"no solution found within the time limit of {time_limit_s:g} s"
    if proven:
        gap = 0.0
    elif objective is not None:
        _, bound = _parse_cbc_log(log_text)
        if bound is not None and objective > 0:
            gap = max(0.0, (objective - bound * net.unit) / objective)
    report = SolverReport(
        solver="PuLP/CBC",
        status=status,
        sol_status=sol_status,
        proven_optimal=proven,
        gap=gap,
        objective_s=objective,
        solve_time_s=elapsed,
        time_limit_s=time_limit_s,
        num_variables=len(prob.variables()),
        num_constraints=len(prob.constraints),
        message=message,
    )
    return IlpResult(evaluation, report)
