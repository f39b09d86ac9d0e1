"""The placement ILP (PuLP + CBC): which devices, in which order, hold which contiguous node spans.

Variables (no explicit positions: the pipeline order is the order of the blocks along the nodes):

- x[i, d] = 1: node i runs on device d. Stage compute time and memory are linear in x.
- st[i, d] / en[i, d]: device d's block starts / ends at node i (exactly x[i](1-x[i-1]) and
  x[i](1-x[i+1]), continuous but integral once x is). At most one start per device makes its
  nodes contiguous; a device with a start is used.
- cut after node i = sum_d st[i+1, d]; the stages after node i's stage: p_i = sum of later cuts.
  Under 1F1B a stage k of S holds min(S - k, m) = min(p + 1, m) micro-batches of activations;
  lev[i, j] = [p_i >= j] (binary) and v[i, d, j] = x[i, d] AND lev[i, j] put that into memory rows.
- f[i, s, h]: a transportation plan from the ending sender class s (host + wire bytes) to the
  starting receiver host h at cut i; integral x makes it the one real pair, so link time
  c_i = sum K f is exact, while the LP relaxation still pays for crossing hosts.

The objective is hetero.planner.objective.pipeline_step_time written in these variables (tests
check it equals brute force); see that module for how it relates to the simulator.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass

import pulp
from hetero.planner.cost import GB, CostTable
from hetero.planner.objective import Evaluation, Placement, evaluate

from hetero.plan import SolverReport


@dataclass
class IlpResult:
    evaluation: Evaluation | None  # None when infeasible or no solution within the time limit
    report: SolverReport


def _identical(a, b) -> bool:  # type: ignore[no-untyped-def]
    """Devices that are interchangeable: same type, host and numbers, nothing overridden."""
    if a.overrides or b.overrides:
        return False
    keys = ("host", "type", "backend", "memory_gb", "memory_bandwidth_gbs", "tflops", "bf16", "nf4", "threads")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def _parse_cbc_log(text: str) -> tuple[float | None, float | None]:
    """(best objective, best bound) from a CBC log when it stopped early; (None, None) otherwise."""
    m = re.search(r"best objective ([-\d.eE+]+)\s*\(best possible ([-\d.eE+]+)\)", text)
    if m:
        return float(m.group(1)), float(m.group(2))
    return None, None


def solve_ilp(
    table: CostTable, num_stages: int | None = None, time_limit_s: float = 30.0, starts: list[Placement] | None = None
) -> IlpResult:
    """Minimize the closed-form step time over placements; the report says how sure the solver is.

    ``starts``: candidate placements (baselines); the best feasible one seeds CBC (MIP start) and is
    returned if the solver finds nothing better within the time limit.
    """
    t0 = time.perf_counter()
    n, nd = table.num_nodes, len(table.devices)
    m = table.num_micro_batches
    gpipe = table.schedule == "gpipe"
    # Times enter the model divided by the slowest single-device compute time, so coefficients are
    # O(1) whatever the model size; the objective is scaled back to seconds below.
    unit = max(sum(table.fwd_s[i][d] + table.bwd_s[i][d] for i in range(n)) for d in range(nd)) or 1.0
    fwd = [[t / unit for t in row] for row in table.fwd_s]
    bwd = [[t / unit for t in row] for row in table.bwd_s]
    N, D = range(n), range(nd)
    devices = table.devices
    prob = pulp.LpProblem("hetero_placement", pulp.LpMinimize)
    max_stages = num_stages if num_stages else min(n, nd)

    x = {(i, d): pulp.LpVariable(f"x_{i}_{d}", cat="Binary") for i in N for d in D}
    st = {(i, d): pulp.LpVariable(f"st_{i}_{d}", 0, 1) for i in N for d in D}
    en = {(i, d): pulp.LpVariable(f"en_{i}_{d}", 0, 1) for i in N for d in D}
    for i in N:
        prob += pulp.lpSum(x[i, d] for d in D) == 1
        for d in D:
            prev = x[i - 1, d] if i > 0 else 0
            nxt = x[i + 1, d] if i + 1 < n else 0
            prob += st[i, d] >= x[i, d] - prev
            prob += st[i, d] <= x[i, d]
            prob += en[i, d] >= x[i, d] - nxt
            prob += en[i, d] <= x[i, d]
            if i > 0:
                prob += st[i, d] <= 1 - prev
            if i + 1 < n:
                prob += en[i, d] <= 1 - nxt
    used = {d: pulp.lpSum(st[i, d] for i in N) for d in D}
    for d in D:
        prob += used[d] <= 1  # one block per device: contiguous spans
        prob += pulp.lpSum(en[i, d] for i in N) == used[d]
    num_used = pulp.lpSum(used.values())
    if num_stages:
        prob += num_used == num_stages
    else:
        prob += num_used <= max_stages
    cut = {i: pulp.lpSum(st[i + 1, d] for d in D) for i in range(n - 1)}
    for i in range(n - 1):
        prob += pulp.lpSum(en[i, d] for d in D) == cut[i]

    # Memory. GB, not bytes: coefficients near 1e9 next to binaries make CBC misjudge feasibility.
    levels = range(1, min(m, max_stages)) if not gpipe else range(0)
    lev = {(i, j): pulp.LpVariable(f"lev_{i}_{j}", cat="Binary") for i in N for j in levels}
    for i in N:
        after = pulp.lpSum(cut[ii] for ii in range(i, n - 1))  # stages after node i's stage
        for j in levels:
            prob += lev[i, j] * (max_stages - j) >= after - (j - 1)
    base_held = m if gpipe else 1
    for d in D:
        w_gb = [(table.weights[i][d] + table.lora[i][d]) / GB for i in N]
        a_gb = [table.activations_per_mb[i][d] / GB for i in N]
        usable = (table.usable_bytes[d] - table.workspace_bytes) / GB
        row = pulp.lpSum(x[i, d] * (w_gb[i] + base_held * a_gb[i]) for i in N)
        worst = sum(w_gb) + (m if gpipe else min(m, max_stages)) * sum(a_gb)
        if worst <= usable:
            continue  # the whole model at its worst position fits: no row needed
        extra = []
        for j in levels:
            for i in N:
                if a_gb[i] > 0:
                    v = pulp.LpVariable(f"v_{i}_{d}_{j}", 0, 1)
                    prob += v >= x[i, d] + lev[i, j] - 1
                    extra.append(a_gb[i] * v)
        prob += row + pulp.lpSum(extra) <= usable * used[d]

    # Link time at each cut, through the transportation plan f (see the module docstring).
    hosts = sorted({dv.host for dv in devices})
    classes: dict[tuple[str, tuple[float, ...]], list[int]] = {}
    for d, dv in enumerate(devices):
        classes.setdefault((dv.host, tuple(table.wire_bytes[i][d] for i in N)), []).append(d)
    comm = {}
    for i in range(n - 1):
        terms = []
        inflow: dict[str, list] = {h: [] for h in hosts}
        for ci, members in enumerate(classes.values()):
            out = []
            for h in hosts:
                receiver = next(d for d in D if devices[d].host == h)
                flow = pulp.LpVariable(f"f_{i}_{ci}_{h}", 0, 1)
                out.append(flow)
                inflow[h].append(flow)
                terms.append(table.transfer_s(i, members[0], receiver) / unit * flow)
            prob += pulp.lpSum(out) == pulp.lpSum(en[i, d] for d in members)
        for h in hosts:
            prob += pulp.lpSum(inflow[h]) == pulp.lpSum(st[i + 1, d] for d in D if devices[d].host == h)
        comm[i] = pulp.lpSum(terms)

    compute = pulp.lpSum(x[i, d] * (fwd[i][d] + bwd[i][d]) for i in N for d in D)
    base = compute + 2 * pulp.lpSum(comm.values())
    if gpipe:
        mf = pulp.LpVariable("period_fwd", lowBound=0)
        mb = pulp.LpVariable("period_bwd", lowBound=0)
        for d in D:
            prob += mf >= pulp.lpSum(x[i, d] * fwd[i][d] for i in N)
            prob += mb >= pulp.lpSum(x[i, d] * bwd[i][d] for i in N)
        for c in comm.values():
            prob += mf >= c
            prob += mb >= c
        prob += base + (m - 1) * (mf + mb)
    else:
        period = pulp.LpVariable("period", lowBound=0)
        for d in D:
            prob += period >= pulp.lpSum(x[i, d] * (fwd[i][d] + bwd[i][d]) for i in N)
        for c in comm.values():
            prob += period >= 2 * c
        prob += base + (m - 1) * period

    # Identical devices are interchangeable: the lower index is used first and comes first.
    for a in D:
        for b in range(a + 1, nd):
            if _identical(devices[a], devices[b]):
                for i in N:
                    prob += pulp.lpSum(st[ii, b] for ii in range(i + 1)) <= pulp.lpSum(st[ii, a] for ii in range(i))
                break  # chaining consecutive identical pairs implies the rest

    start: Evaluation | None = None
    for cand in starts or []:
        ev = evaluate(table, cand)
        if ev.feasible and (not num_stages or len(cand.devices) == num_stages):
            if start is None or ev.step_time_s < start.step_time_s:
                start = ev
    if start is not None:
        owner = {i: d for d, (a, b) in zip(start.placement.devices, start.placement.spans, strict=True)
                 for i in range(a, b + 1)}
        for (i, d), var in x.items():
            var.setInitialValue(1 if owner[i] == d else 0)
        num = len(start.placement.devices)
        for k, (_, (a, b)) in enumerate(zip(start.placement.devices, start.placement.spans, strict=True)):
            for i in range(a, b + 1):
                for j in levels:
                    lev[i, j].setInitialValue(1 if num - 1 - k >= j else 0)

    fd, log_path = tempfile.mkstemp(prefix="hetero_cbc_", suffix=".log")
    os.close(fd)
    try:
        solver = pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, logPath=log_path, gapRel=1e-9, warmStart=start is not None
        )
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
        evaluation = _extract(table, x, st)
        objective = pulp.value(prob.objective) * unit
        if start is not None and start.step_time_s < evaluation.step_time_s:
            evaluation, objective = start, start.step_time_s
        if proven:
            gap = 0.0
        else:
            best, bound = _parse_cbc_log(log_text)
            if best is not None and bound is not None and best > 0:
                gap = max(0.0, (best - bound) / abs(best))  # scale-free: unit cancels
            message = f"time limit of {time_limit_s:g} s reached before optimality was proven"
    elif prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        message = "no placement satisfies the memory limits"
    elif start is not None:
        evaluation, objective = start, start.step_time_s
        message = f"no better placement found within {time_limit_s:g} s: kept the best baseline placement"
    else:
        message = f"no solution found within the time limit of {time_limit_s:g} s"
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


def _extract(table: CostTable, x, st) -> Evaluation:  # type: ignore[no-untyped-def]
    """Read the placement out of the solved variables (rounded: CBC returns floats)."""
    blocks = []
    for d in range(len(table.devices)):
        nodes = [i for i in range(table.num_nodes) if (pulp.value(x[i, d]) or 0.0) > 0.5]
        if nodes:
            blocks.append((min(nodes), max(nodes), d))
    blocks.sort()
    return evaluate(table, Placement(tuple(d for _, _, d in blocks), tuple((a, b) for a, b, _ in blocks)))
