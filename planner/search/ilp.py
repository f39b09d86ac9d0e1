"""The placement ILP (PuLP + CBC): one path with side constraints through a layered network.

A placement is a path through planner/search/network.py's network: each arc is one stage (device d runs
nodes i..j) or one link, so stage times, link times and memory are precomputed per arc and the LP
relaxation is a flow (tight), not big-M positions and orders. Memory needs no rows (arcs that do
not fit are never created; a flat network adds one row per cut for micro-batches in flight).

- Flow conservation from the source (a stage starting at node 0) to the sink (one ending last).
- Each device runs at most one stage, so per-device sums of arc times bound the period (the max
  term of the objective); so do the links at each cut and the stages covering each node.
- Identical devices (equal cost-table columns, same host) are used in index order.
- A MIP start from the best known placement (the baselines and the split DP of planner/search/splits.py)
  also prunes arcs that cannot beat it.

The objective is hetero.planner.model.objective.pipeline_step_time in these variables (tests check it
against brute force). CBC searches exactly (no gap, a tiny cutoff increment on an objective scaled to
be >= 1) against the wall clock, and is killed if it overruns; its solution status is checked, and a
time-limited run reports its gap. planner.search.solve runs this when the exact DP (planner/search/exact.py) cannot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pulp

from hetero.plan import SolverReport
from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Evaluation, Placement, evaluate
from hetero.planner.schedule.step_form import PeriodGroup, linear_step
from hetero.planner.search.deadline import OutOfTime, check
from hetero.planner.search.network import (
    LinkArc,
    Network,
    StageArc,
    build_network,
    canonical,
    head_state,
    tail_state,
)
from hetero.planner.search.splits import dp_starts

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
        self.table, self.net = table, net
        prob = pulp.LpProblem("hetero_placement", pulp.LpMinimize)
        self.y = {a: pulp.LpVariable(f"y{k}", cat="Binary") for k, a in enumerate(net.stages)}
        # Links and the leave-the-cap arcs are integral once the stages are: continuous suffices.
        self.z = {a: pulp.LpVariable(f"z{k}", 0, 1) for k, a in enumerate(net.links)}
        self.down: dict[tuple[int, int], pulp.LpVariable] = {}
        self._flow_rows(prob)
        by_device = self._device_rows(prob, num_stages)
        self.after: dict[int, pulp.LpVariable] = {}
        if net.flat:
            self._in_flight_rows(prob)
        self._period_rows(prob, by_device)
        self._ram_rows(prob)
        prob += linear_step(_expr((v, a.fwd + a.bwd) for a, v in self.y.items())
                            + _expr((v, 2.0 * a.time) for a, v in self.z.items()),
                            table.num_micro_batches, pulp.lpSum(self.periods))
        self.prob = prob

    def _ram_rows(self, prob: pulp.LpProblem) -> None:
        """Per host: what its stages stream fits in its RAM (arcs carry every Pareto pair where it may bind)."""
        by_host: dict[int, list[StageArc]] = defaultdict(list)
        for a in self.net.stages:
            if a.host_bytes > 0:
                by_host[self.table.host_of[a.device]].append(a)
        for h, arcs in by_host.items():
            prob += _expr((self.y[a], a.host_bytes) for a in arcs) <= self.table.host_ram_bytes[h], f"ram_{h}"

    def _flow_rows(self, prob: pulp.LpProblem) -> None:
        """One unit of flow from the source (a stage starting at node 0), conserved at every state."""
        table, net = self.table, self.net
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

    def _device_rows(self, prob: pulp.LpProblem, num_stages: int | None) -> dict[int, list[StageArc]]:
        """Each device runs at most one stage (twins in index order), and the stage count if forced;
        returns the stage arcs per device."""
        by_device: dict[int, list[StageArc]] = defaultdict(list)
        for a in self.net.stages:
            by_device[a.device].append(a)
        used = {d: pulp.lpSum(self.y[a] for a in arcs) for d, arcs in by_device.items()}
        for u in used.values():
            prob += u <= 1
        if num_stages:
            prob += pulp.lpSum(self.y.values()) == num_stages
        for a, b in self.net.twins:  # b only after a, and only if a is used
            if b not in used:
                continue  # no arc left for b: nothing to order
            ua, ub = used.get(a, 0), used[b]
            prob += ub <= ua
            pos_a = pulp.lpSum(arc.first * self.y[arc] for arc in by_device.get(a, []))
            pos_b = pulp.lpSum(arc.first * self.y[arc] for arc in by_device.get(b, []))
            prob += pos_a + ub <= pos_b + self.table.num_nodes * (1 - ub)
        return by_device

    def _period_weights(self) -> tuple[list[Callable[[StageArc], float]], list[float]]:
        """Make one period variable per period group of the schedule's step form; the arc time each one
        bounds and how many times a link counts in it."""
        groups = self.table.form.groups
        self.periods = [pulp.LpVariable(f"period{p}", 0) for p in range(len(groups))]
        return [partial(_group_time, g) for g in groups], [g.link for g in groups]

    def _period_rows(self, prob: pulp.LpProblem, by_device: dict[int, list[StageArc]]) -> None:
        """The max terms, bounded by every set of arcs of which at most one (unit) is used: the arcs of
        one device, the links at one cut, and the arcs covering one node."""
        starting: dict[int, list[StageArc]] = defaultdict(list)
        ending: dict[int, list[StageArc]] = defaultdict(list)
        for a in self.net.stages:
            starting[a.first].append(a)
            ending[a.last].append(a)
        links_at: dict[int, list[LinkArc]] = defaultdict(list)
        for a in self.net.links:
            links_at[a.cut].append(a)
        weights, link_factors = self._period_weights()
        self.covers: list[tuple[list[pulp.LpVariable], object]] = []
        for p, (period, weight, link_factor) in enumerate(zip(self.periods, weights, link_factors, strict=True)):
            for arcs in by_device.values():
                prob += _expr((self.y[a], weight(a)) for a in arcs) <= period
            for arcs in links_at.values():
                prob += _expr((self.z[link], link_factor * link.time) for link in arcs) <= period
            self._cover_rows(prob, p, period, weight, starting, ending)

    def _cover_rows(self, prob: pulp.LpProblem, p: int, period: pulp.LpVariable,
                    weight: Callable[[StageArc], float], starting: dict[int, list[StageArc]],
                    ending: dict[int, list[StageArc]]) -> None:
        """The arcs covering each node bound the period, as a running sum (plus arcs starting at node
        k, minus arcs ending at k-1) so each arc appears twice, not once per node it covers."""
        prev: pulp.LpVariable | None = None
        self.covers.append(([], weight))
        for k in range(self.table.num_nodes):
            cover = pulp.LpVariable(f"cover{p}_{k}", 0)
            terms = [(self.y[a], weight(a)) for a in starting[k]]
            terms += [(self.y[a], -weight(a)) for a in ending[k - 1]] if k else []
            terms += [(prev, 1.0)] if prev is not None else []
            prob += _expr(terms) == cover
            prob += cover <= period
            self.covers[-1][0].append(cover)
            prev = cover

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
        by_position = table.form.by_position
        chosen: set[tuple[int, int, int, int, int, int]] = set()
        links: set[tuple[int, int, int, str]] = set()
        downs: set[tuple[int, int]] = set()
        for k, (d, (a, b)) in enumerate(zip(pl.devices, pl.spans, strict=True)):
            q = min(num - k, net.cap) if by_position else 1
            chosen.add((d, a, b, q, ev.recompute[k] if ev.recompute else 0, ev.stream[k] if ev.stream else 0))
            if k > 0:
                prev = pl.devices[k - 1]
                links.add((a, q, net.group_of[prev], table.host_of[d]))
                if by_position and q < net.cap and min(num - k + 1, net.cap) == net.cap:
                    downs.add((a, net.group_of[prev]))
        ys = {(a.device, a.first, a.last, a.state, a.recompute, a.stream): v for a, v in self.y.items()}
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
                if (a.device, a.first, a.last, a.state, a.recompute, a.stream) in chosen:
                    for k in range(a.first, a.last + 1):
                        covers[k].setInitialValue(weight(a))  # type: ignore[operator]
        periods = table.form.periods([f / net.unit for f in ev.fwd_s], [b / net.unit for b in ev.bwd_s],
                                     [c / net.unit for c in ev.send_s[:-1]])
        for var, value in zip(self.periods, periods, strict=True):
            var.setInitialValue(value)
        return True

    def extract(self) -> Evaluation:
        """Read the placement out of the solved variables (rounded: CBC returns floats)."""
        arcs = sorted((a for a, v in self.y.items() if (v.varValue or 0.0) > 0.5), key=lambda a: a.first)
        return evaluate(self.table, Placement(tuple(a.device for a in arcs), tuple((a.first, a.last) for a in arcs),
                                              tuple(a.recompute for a in arcs), tuple(a.stream for a in arcs)))


# CBC stops itself at its time limit; past the deadline by this much it is killed (its root LP and
# preprocessing do not look at the clock), so a solve never overruns planner.time_limit_s by more.
CBC_GRACE_S = 0.5
# Exact search: no gap, and a new solution need only be this much better (in units of Network.unit,
# i.e. relative to a lower bound on the step time) than the last, instead of CBC's absolute 1e-5.
CBC_INCREMENT = 1e-9


def _group_time(group: PeriodGroup, arc: StageArc) -> float:
    """A stage arc's time in one period group."""
    return float(group.stage(arc.fwd, arc.bwd))


def run_cbc(prob: pulp.LpProblem, warm: bool, deadline: float) -> tuple[bool, str]:
    """Solve ``prob`` with the bundled CBC (one thread, exact tolerances, wall-clock limit) until
    ``deadline`` (time.perf_counter()); (finished, log). Finished: prob holds CBC's statuses and values."""
    with warnings.catch_warnings():  # PuLP 3 deprecates the bundled binary's class, not the binary
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False)
    tmp = tempfile.mkdtemp(prefix="hetero_cbc_")
    mps, sol, mst, log = (os.path.join(tmp, name) for name in ("p.mps", "p.sol", "p.mst", "p.log"))
    try:
        names = prob.writeMPS(mps, rename=1)[:3]
        args = [str(solver.path), mps]
        if warm:
            solver.writesol(mst, prob, *names)
            args += ["-mips", mst]
        seconds = max(0.05, deadline - time.perf_counter())
        args += ["-sec", f"{seconds:.3f}", "-timeMode", "elapsed", "-threads", "1", "-allowableGap", "0",
                 "-ratioGap", "0", "-increment", f"{CBC_INCREMENT:g}", "-solve", "-printingOptions", "all",
                 "-solution", sol]
        with open(log, "w") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                proc.wait(timeout=seconds + CBC_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with open(log, errors="replace") as fh:
            text = fh.read()
        if proc.returncode != 0 or not os.path.exists(sol):
            return False, text
        status, values, _, _, _, sol_status = solver.readsol_MPS(sol, prob, *names)
        prob.assignVarsVals(values)
        prob.assignStatus(status, sol_status)
        return True, text
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _starting_point(table: CostTable, num_stages: int | None, starts: list[Placement] | None, split_dp: bool,
                    deadline: float) -> Evaluation | None:
    """The best known placement: the candidates, and the split DP's if asked (until the deadline)."""
    start = _best_start(table, num_stages, starts)
    if split_dp:
        found = dp_starts(table, num_stages, deadline=deadline)
        if found and (start is None or found[0].step_time_s < start.step_time_s):
            start = found[0]
    return start


def solve_ilp(
    table: CostTable,
    num_stages: int | None = None,
    time_limit_s: float = 30.0,
    starts: list[Placement] | None = None,
    split_dp: bool = True,
    layered: bool | None = None,
    deadline: float | None = None,
) -> IlpResult:
    """Minimize the closed-form step time over placements; the report says how sure the solver is.

    ``starts``: candidate placements (baselines); with ``split_dp`` also the split DP's placements
    (planner/search/splits.py). The best feasible one bounds the search (arcs that cannot beat it are
    pruned), seeds CBC (MIP start) and is returned if CBC finds nothing better. ``layered``: see
    build_network (None: automatic). Everything (heuristics, network, CBC) ends by ``deadline``
    (time.perf_counter(); default: now + time_limit_s), plus at most CBC_GRACE_S.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s if deadline is None else deadline
    start = _starting_point(table, num_stages, starts, split_dp, deadline)
    try:
        net = build_network(table, num_stages, start.step_time_s if start is not None else None, layered, deadline)
        model = _Model(table, net, num_stages)
        check(deadline)
    except OutOfTime:
        return _out_of_time(table, start, time_limit_s, t0)
    if start is not None:
        start = evaluate(table, canonical(start.placement, net.twins))  # same costs: twins are identical
    finished, log_text = run_cbc(model.prob, start is not None and model.warm_start(start), deadline)
    return _report(table, model, start, finished, log_text, time_limit_s, t0)


def _out_of_time(table: CostTable, start: Evaluation | None, time_limit_s: float, t0: float) -> IlpResult:
    """The deadline passed before CBC could start: the best heuristic placement, unproven."""
    message = (f"the time limit of {time_limit_s:g} s ran out while building the ILP: kept the best heuristic "
               "placement" if start is not None else
               f"the time limit of {time_limit_s:g} s ran out while building the ILP")
    report = SolverReport("PuLP/CBC", "Not Solved", "No Solution Found", False, None,
                          start.step_time_s if start is not None else None, time.perf_counter() - t0,
                          time_limit_s, message=message)
    return IlpResult(start, report)


def _report(table: CostTable, model: _Model, start: Evaluation | None, finished: bool, log_text: str,
            time_limit_s: float, t0: float) -> IlpResult:
    """Read CBC's answer (checked: sol_status, not only status) into an evaluation and a report."""
    prob, net = model.prob, model.net
    status = pulp.LpStatus[prob.status] if finished else "Not Solved"
    sol_status = pulp.LpSolution.get(prob.sol_status, str(prob.sol_status)) if finished else "No Solution Found"
    has_solution = finished and prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    proven = finished and prob.sol_status == pulp.LpSolutionOptimal
    evaluation, objective, gap, message = None, None, None, ""
    if has_solution:
        evaluation = model.extract()
        objective = evaluation.step_time_s
        if not evaluation.feasible:
            proven, evaluation, objective = False, None, None
        if start is not None and (evaluation is None or start.step_time_s < evaluation.step_time_s):
            # CBC's "optimal" must not lose to a placement it was given (tolerances): then it is not proven.
            if evaluation is not None and start.step_time_s < evaluation.step_time_s * (1 - 1e-7):
                proven = False
            evaluation, objective = start, start.step_time_s
        if not proven:
            message = f"time limit of {time_limit_s:g} s reached before optimality was proven"
    elif start is not None:
        # The start's arcs are in the network, so CBC can only have run out of time.
        evaluation, objective = start, start.step_time_s
        message = f"no better placement found within {time_limit_s:g} s: kept the best heuristic placement"
    elif finished and (prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible):
        message = "no placement satisfies the memory limits"
        proven = True
    else:
        message = f"no solution found within the time limit of {time_limit_s:g} s"
    if proven and evaluation is not None:
        gap = 0.0
    elif objective is not None:
        _, bound = _parse_cbc_log(log_text)
        if bound is not None and objective > 0:
            gap = max(0.0, (objective - bound * net.unit) / objective)
    report = SolverReport(
        solver="PuLP/CBC",
        status=status,
        sol_status=sol_status,
        proven_optimal=proven and evaluation is not None,
        gap=gap,
        objective_s=objective,
        solve_time_s=time.perf_counter() - t0,
        time_limit_s=time_limit_s,
        num_variables=len(prob.variables()),
        num_constraints=len(prob.constraints),
        message=message,
    )
    return IlpResult(evaluation, report)
