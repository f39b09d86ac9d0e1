"""The placement solve: the simulator's step time decides, the exact DP or the ILP finds the start.

``solve_simulated`` is what planner.plan calls: the placement with the smallest simulated step time
(the number the plan reports), found and proven by planner/search/simsearch.py from the closed-form optimum.
The report says what the proof covers: "optimal by the simulated step time" when the branch and bound
finished (no placement simulates faster), else that the search was cut off, the gap to its lower bound,
and what the closed form's optimum simulates at.

``solve`` (the closed form, objective.pipeline_step_time) is a pure function of a CostTable (dense arrays; no fleet, no cost model). The exact DP
(planner/search/exact.py) proves the optimum of fleets with few device classes -- a rig of 3080s and
3090s, hosts of identical GPUs -- in about a second; when its state space is too large (many
distinct devices) or it runs out of its share of the time, the ILP (planner/search/ilp.py) gets what is
left of planner.time_limit_s, seeded with the best placement known. The report says which solver
proved the optimum, or how far from proven the plan is (gap against the best lower bound of both).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hetero.plan import SolverReport
from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Evaluation, Placement, evaluate, ram_may_bind
from hetero.planner.search.deadline import BOUND_SHARE, CLOSED_SHARE, DP_SHARE, SEARCH_SHARE
from hetero.planner.search.exact import ExactResult, solve_exact
from hetero.planner.search.simsearch import SearchResult, best_simulated, simulated_step_s
from hetero.planner.search.step_bound import least_step_bound

EXACT = "exact DP"
# The step form's bound's best placements, up to this many, join the simulated search's candidates.
BOUND_STARTS = 12
SEARCH = "simulated search"
PROVEN = "optimal by the simulated step time"


@dataclass
class SolveResult:
    evaluation: Evaluation | None  # None: no placement fits (proven), or none found in time
    report: SolverReport


def _best_of(table: CostTable, num_stages: int | None, starts: list[Placement] | None) -> Evaluation | None:
    """The fastest feasible candidate with the requested number of stages."""
    best: Evaluation | None = None
    for cand in starts or []:
        if num_stages and len(cand.devices) != num_stages:
            continue
        ev = evaluate(table, cand)
        if ev.feasible and (best is None or ev.step_time_s < best.step_time_s):
            best = ev
    return best


def solve(table: CostTable, num_stages: int | None = None, time_limit_s: float = 30.0,
          starts: list[Placement] | None = None, exact: bool = True) -> SolveResult:
    """The placement minimizing objective.pipeline_step_time, within ``time_limit_s`` (plus at most
    the ILP's CBC_GRACE_S); ``starts`` are heuristic candidates (upper bounds, MIP starts)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    start = _best_of(table, num_stages, starts)
    dp: ExactResult | None = None
    if exact and not ram_may_bind(table):  # the DP does not see host RAM; the ILP's RAM rows do
        dp = solve_exact(table, num_stages, t0 + DP_SHARE * time_limit_s,
                         start.step_time_s if start is not None else None)
        proven = _proven_by_dp(table, dp, start, time_limit_s, t0) if dp.proven else None
        if proven is not None:
            return proven
        if dp.placement is not None:
            found = evaluate(table, dp.placement)
            if found.feasible and (start is None or found.step_time_s < start.step_time_s):
                start = found
    seeds = ([start.placement] if start is not None else []) + list(starts or [])
    from hetero.planner.search.ilp import (
        solve_ilp,  # PuLP: only when the ILP runs (the coordinator's replanner never does)
    )

    ilp = solve_ilp(table, num_stages, time_limit_s, starts=seeds, deadline=deadline)
    report = ilp.report
    evaluation = ilp.evaluation
    if evaluation is None and start is not None:
        evaluation = start
    lower = None
    if dp is not None and dp.lower_bound_s is not None:
        lower = dp.lower_bound_s
    if evaluation is not None and not report.proven_optimal:
        ilp_lower = evaluation.step_time_s * (1 - report.gap) if report.gap is not None else None
        lower = max([b for b in (lower, ilp_lower) if b is not None], default=None)
        gap = None if lower is None else max(0.0, (evaluation.step_time_s - lower) / evaluation.step_time_s)
        report = replace(report, gap=gap, objective_s=evaluation.step_time_s)
    if dp is not None and dp.reason:
        report = replace(report, message=f"{dp.reason}, so the ILP ran" + (f": {report.message}" if report.message else ""))
    return SolveResult(evaluation, replace(report, solve_time_s=time.perf_counter() - t0))


def _proven_by_dp(table: CostTable, dp: ExactResult, start: Evaluation | None, time_limit_s: float,
                  t0: float) -> SolveResult | None:
    """The DP finished: its placement (or the start it could not beat) is optimal, or nothing fits.
    None if its placement does not check out under objective.evaluate (a bug: the ILP decides then)."""
    evaluation = evaluate(table, dp.placement) if dp.placement is not None else start
    if evaluation is not None and (not evaluation.feasible or dp.value_s is not None and not
                                   abs(evaluation.step_time_s - dp.value_s) <= 1e-9 * dp.value_s):
        return None
    message = f"{dp.dp_runs} threshold DP(s)"
    if evaluation is None:
        report = SolverReport(EXACT, "Infeasible", "No Solution Exists", False, None, None,
                              time.perf_counter() - t0, time_limit_s, message="no placement satisfies the memory limits")
        return SolveResult(None, report)
    if start is not None and start.step_time_s < evaluation.step_time_s:
        evaluation = start  # equal to float noise (REL_TOL): keep the known one
    report = SolverReport(EXACT, "Optimal", "Optimal Solution Found", True, 0.0, evaluation.step_time_s,
                          time.perf_counter() - t0, time_limit_s, message=message)
    return SolveResult(evaluation, report)


def solve_simulated(table: CostTable, num_stages: int | None = None, time_limit_s: float = 30.0,
                    starts: list[Placement] | None = None, deadline: float | None = None) -> SolveResult:
    """The placement minimizing the simulated step time (planner/search/simsearch.py), from the closed form's
    optimum (``solve``) and ``starts``; ends by ``deadline`` (default: SEARCH_SHARE of the limit from now)."""
    t0 = time.perf_counter()
    end = t0 + SEARCH_SHARE * time_limit_s if deadline is None else deadline
    ram = ram_may_bind(table)  # then the closed form's optimum is the plan: it gets the whole time
    closed = solve(table, num_stages, max(0.05, end - t0 if ram else min(CLOSED_SHARE * time_limit_s, end - t0)),
                   starts=starts)
    if closed.evaluation is None and (closed.report.status == "Infeasible"
                                      or closed.report.sol_status == "No Solution Exists"):
        return closed  # proven: nothing fits (planner.explain.feasibility explains why)
    if ram:
        # Host RAM may bind: the simulated search prices each stage's pair alone; the closed form's
        # optimum (the ILP with its RAM rows) is the plan.
        return closed
    candidates = [closed.evaluation] if closed.evaluation is not None else []
    candidates += [evaluate(table, p) for p in starts or []]
    # The step form's bound over every placement: what the plan can say when the search is cut off, and
    # the placements its DPs chose, which simulate fast (planner/search/step_bound.py).
    bound = least_step_bound(table, num_stages, time.perf_counter() + BOUND_SHARE * max(0.0, end - time.perf_counter()))
    candidates += [evaluate(table, p) for p in bound.placements[:BOUND_STARTS]] if bound is not None else []
    found = best_simulated(table, candidates, num_stages, end)
    if found.best is None:
        return closed
    by_bound = False
    if bound is not None and not found.proven:
        found = _with_bound(found, bound.bound_s)
        by_bound = found.proven
    closed_s = simulated_step_s(table, closed.evaluation) if closed.evaluation is not None else None
    report = _search_report(closed.report, found, closed_s, time_limit_s, time.perf_counter() - t0,
                            bound.bound_s if bound is not None else None, by_bound)
    return SolveResult(found.best.evaluation, report)


def _with_bound(found: SearchResult, bound_s: float) -> SearchResult:
    """The search's result with the step form's bound over every placement: proven when the bound meets it."""
    assert found.best is not None
    lower = max(found.lower_bound_s or 0.0, bound_s)
    if lower >= found.best.step_s * (1 - 1e-9):
        return replace(found, proven=True, lower_bound_s=found.best.step_s)
    return replace(found, lower_bound_s=lower)


def _search_report(closed: SolverReport, found: SearchResult, closed_s: float | None, time_limit_s: float,
                   elapsed: float, bound_s: float | None = None, by_bound: bool = False) -> SolverReport:
    """What the simulated search proved (or how far it got), and how the closed form's optimum compares."""
    assert found.best is not None
    step = found.best.step_s
    work = f"{found.simulated} placements simulated, {found.nodes:,} partial pipelines bounded"
    if closed_s is None:
        versus = f"the closed-form solve ({closed.solver}) found no placement in its share of the time"
    elif closed_s > step * (1 + 1e-9):
        versus = (f"the closed-form optimum ({closed.solver}) simulates at {closed_s:.4g} s/step: this placement "
                  f"simulates faster, {step:.4g} s")
    else:
        versus = f"the closed-form optimum ({closed.solver}) is this placement"
    solver = f"{closed.solver} + {SEARCH}"
    if found.proven:
        return SolverReport(solver, "Optimal", "Optimal Solution Found", True, 0.0, step, elapsed, time_limit_s,
                            closed.num_variables, closed.num_constraints,
                            message=f"{PROVEN}: " + ("the schedule's bound over every placement (planner/search/step_bound.py) "
                                                     f"meets it ({work} before that)" if by_bound else
                                                     f"the branch and bound finished ({work})") + f"; {versus}")
    lower = found.lower_bound_s
    gap = None if lower is None else max(0.0, (step - lower) / step)
    bound = f"; best lower bound {lower:.4g} s/step" if lower is not None else ""
    if lower is not None and bound_s is not None and lower <= bound_s:
        bound += " (the schedule's bound over every placement, planner/search/step_bound.py)"
    return SolverReport(solver, "Not Solved", "Solution Found", False, gap, step, elapsed, time_limit_s,
                        closed.num_variables, closed.num_constraints,
                        message=f"the search by simulated step time was cut off by the time limit ({work}{bound}); "
                                f"{versus}", lower_bound_s=lower)
