"""One pipeline or data x pipeline replicas: the choice by the simulator, and what the plan may call settled.

The replica search (planner/replica/replicas.py) ranks plans by the closed-form step (the slowest replica's
objective.evaluate step + the gradient reduction); the plan reports the simulator's step
(predict_replicas). So the search proposes and the simulator decides: replicas are planned only when
they simulate faster than the one pipeline (or planner.replicas asks for them), and when the search
proves that one pipeline wins, the best two replicas are still simulated against it.

A plan answers four questions (hetero.plan.SETTLED_PARTS): how many stages, the replicas (how many,
their shares), which layers recompute, which device runs which layers. The placement solve answers
the first, third and fourth; the replica search the second. Each is settled when its search finished
(or the settings fix it): proven_optimal only when all four are, and every part that is not says what
was searched and for how long, with the best lower bound known.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from hetero.errors import InfeasiblePlanError
from hetero.plan import SETTLED_PARTS, Prediction, SolverReport
from hetero.planner.model.cost import CostTable, subtable
from hetero.planner.model.objective import Evaluation, ram_reasons
from hetero.planner.model.predict import predict
from hetero.planner.replica.replicas import ReplicaSolution, solve_replicas
from hetero.planner.schedule.simulator import combine_replicas
from hetero.planner.search.deadline import MIN_REPLICA_S, REPLICA_SHARE, left, reserve_s
from hetero.specs import PlannerOptions

Chosen = list[tuple[Evaluation, int, float]]  # per pipeline replica: its placement, micro-batches, own step time


def searches_replicas(options: PlannerOptions, table: CostTable) -> bool:
    """Whether planner.plan searches data x pipeline replicas on this fleet with these settings (never under
    planner.interleave=always: interleaved chunks do not form replicas)."""
    auto = options.split is None and options.devices is None and options.interleave != "always"
    asked = options.replicas != 1 and (options.num_stages is None or options.replicas is not None)
    return auto and asked and table.num_devices >= 2 and table.num_micro_batches >= 2


def predict_replicas(table: CostTable, evaluations: list[Evaluation], shares: list[int], reduce_s: float,
                     ) -> tuple[Prediction, list[float]]:
    """The simulator's prediction of data x pipeline replicas: each replica with its own share, then
    the optimizer step's barrier with the gradient reduction (simulator.combine_replicas); and each
    replica's own simulated step (before the reduction)."""
    timelines = [predict(subtable(table, m), ev)[1] for ev, m in zip(evaluations, shares, strict=True)]
    timeline = combine_replicas(timelines, reduce_s)
    tokens = table.tokens * table.num_micro_batches
    step = timeline.step_time_s
    prediction = Prediction(step_time_s=step, tokens_per_step=tokens, tokens_per_s=tokens / step if step > 0 else 0.0,
                            bubble_fraction=timeline.bubble_fraction, stage_busy=timeline.busy_fraction,
                            stage_memory_gb=[mem.total_gb for ev in evaluations for mem in ev.memory],
                            reduce_s=reduce_s)
    return prediction, [t.step_time_s for t in timelines]


def _ratio(x: float) -> str:
    """1.24x; 1.004x where two decimals would round a real difference away."""
    return f"{x:.3f}x" if abs(x - 1) < 0.01 else f"{x:.2f}x"


def _lower(report: SolverReport) -> float | None:
    """The placement solve's lower bound on a single pipeline's step (its value when proven)."""
    if report.objective_s is None:
        return None
    if report.proven_optimal:
        return report.objective_s
    return None if report.gap is None else report.objective_s * (1 - report.gap)


def settle_single(report: SolverReport, options: PlannerOptions, table: CostTable) -> SolverReport:
    """The placement solve's answers: stages, recompute and placement settled when it proved its optimum
    (stages also when planner.num_stages fixes them, recompute when planner.recompute does)."""
    if report.solver == "manual":
        return report
    proven, lower = report.proven_optimal, _lower(report)
    settled = {"stages": proven or options.num_stages is not None, "recompute": proven or table.recompute_mode != "auto",
               "placement": proven}
    bound = f"; best lower bound {lower:.4g} s/step" if lower is not None and not proven else ""
    why = f"the placement search ran {report.solve_time_s:.1f} s and was cut off before it finished{bound}"
    return replace(report, settled=settled, unsettled={k: why for k, ok in settled.items() if not ok},
                   lower_bound_s=None if proven else lower)


def _settle_replicas(report: SolverReport, settled: bool, why: str = "", lower: float | None = None,
                     **changes: object) -> SolverReport:
    """``report`` with the replica question answered; proven_optimal only when every part is settled."""
    parts = {**report.settled, "replicas": settled}
    unsettled = {k: v for k, v in report.unsettled.items() if k != "replicas"} | ({} if settled else {"replicas": why})
    bounds = [b for b in (report.lower_bound_s if report.lower_bound_s is not None else _lower(report), lower)
              if b is not None and math.isfinite(b)]
    proven = all(parts.get(k, False) for k in SETTLED_PARTS)
    return replace(report, **changes, settled=parts, unsettled=unsettled,  # type: ignore[arg-type]
                   proven_optimal=proven, lower_bound_s=None if proven or not bounds else min(bounds))


def settle(report: SolverReport, options: PlannerOptions, table: CostTable) -> SolverReport:
    """The final report: a replica question nobody searched is settled by the settings (planner.replicas=1,
    planner.num_stages, one device or one micro-batch); proven_optimal only when every part is settled."""
    if report.solver == "manual" or "replicas" in report.settled:
        return report
    return _settle_replicas(report, True)


def choose_replicas(table: CostTable, options: PlannerOptions, single: Prediction, single_solver: SolverReport,
                    single_ev: Evaluation, deadline: float | None = None,
                    ) -> tuple[Chosen | None, Prediction, SolverReport, list[str]]:
    """Data x pipeline replicas when they simulate faster than the one pipeline (or planner.replicas asks
    for them): the replicas with their shares (None: keep the one pipeline), the prediction, the solver
    report (its replica question settled or not) and the verdict lines. Ends by ``deadline``."""
    t0 = time.perf_counter()
    forced = options.replicas
    if forced is None and (table.num_devices < 2 or table.num_micro_batches < 2):
        return None, single, _settle_replicas(single_solver, True), []  # no two replicas to be had
    end = t0 + max(0.05, left(deadline)) if deadline is not None else t0 + options.time_limit_s
    if forced is None:  # the last search: what is left, but what the plan keeps back
        end = (max(t0 + 0.05, deadline - reserve_s(options.time_limit_s)) if deadline is not None
               else min(end, t0 + max(MIN_REPLICA_S, REPLICA_SHARE * options.time_limit_s)))
    solution = solve_replicas(table, max_replicas=forced, num_replicas=forced, num_stages=options.num_stages,
                              deadline=end, single=(single_ev, True))
    if forced is not None and (solution is None or solution.num_replicas != forced):
        raise InfeasiblePlanError(f"planner.replicas={forced}: no {forced} replicas of the model fit on this fleet "
                                  f"(each replica holds the whole model on its own devices)")
    searched = f"searched {time.perf_counter() - t0:.1f} s"
    if solution is not None and solution.num_replicas < 2 and solution.proven_optimal:
        return _versus_two(table, options, single, single_solver, deadline)
    if solution is None or solution.num_replicas < 2:
        lower = _bound(solution)
        floor = (f"; every plan of replicas takes at least {lower:.4g} s/step by the closed-form step"
                 if lower is not None and math.isfinite(lower) else "")
        why = (f"{searched} without proving whether any beat one pipeline "
               f"({'; '.join(solution.unproven) if solution else 'nothing found'}{floor})")
        return None, single, _settle_replicas(single_solver, False, why, lower), []
    short = ram_reasons(table, tuple(d for e in solution.evaluations for d in e.placement.devices),
                        [b for e in solution.evaluations for b in e.stream_bytes])
    if short:  # each replica fits its hosts' RAM alone; together they share it
        if forced is not None:
            raise InfeasiblePlanError(f"planner.replicas={forced}: the replicas' streamed weights do not fit: "
                                      + "; ".join(short))
        return None, single, _settle_replicas(single_solver, False, "replicas: " + "; ".join(short)), []
    prediction, own = predict_replicas(table, solution.evaluations, solution.shares, solution.reduce_s)
    if forced is None and prediction.step_time_s >= single.step_time_s:
        why = (f"the replica search's best ({solution.num_replicas} replicas, shares "
               f"{'+'.join(map(str, solution.shares))}) simulates slower than one pipeline; other replica plans "
               "were not simulated")
        return None, single, _settle_replicas(single_solver, False, why), [
            f"Replicas ({solution.num_replicas}, shares {'+'.join(map(str, solution.shares))}) win by the closed "
            f"form but simulate at {prediction.step_time_s:.3g} s/step against {single.step_time_s:.3g} s: one "
            "pipeline is planned."]
    why = f"{searched}, not proven: {'; '.join(solution.unproven)}"
    report = _settle_replicas(
        single_solver, solution.proven_optimal, why, _bound(solution),
        solver=f"{single_solver.solver} + replica search", objective_s=prediction.step_time_s,
        solve_time_s=single_solver.solve_time_s + time.perf_counter() - t0,
        message=f"{single_solver.message}; replicas: {_replica_message(solution)}")
    return _replica_choice(table, solution, prediction, own, single, report)


def _bound(solution: ReplicaSolution | None) -> float | None:
    """The replica search's lower bound on every replica plan (None: none known)."""
    return None if solution is None else solution.replicas_lower_s


def _replica_message(solution: ReplicaSolution) -> str:
    """What the replica search did and what its proof covers, without its closed-form step times (the plan's
    step times are the simulator's)."""
    proof = ("proven optimal by the closed-form step (slowest replica + gradient reduction)"
             if solution.proven_optimal else "not proven")
    return (f"{solution.num_replicas} replicas, shares {'+'.join(map(str, solution.shares))}, {proof}; chosen over "
            f"one pipeline by the simulated step ({solution.how})")


def _versus_two(table: CostTable, options: PlannerOptions, single: Prediction, single_solver: SolverReport,
                deadline: float | None) -> tuple[Chosen | None, Prediction, SolverReport, list[str]]:
    """One pipeline wins by the closed form (proven): the best two replicas simulated against it, in the
    time left; two replicas are planned if they simulate faster (the replica question is then open)."""
    t0 = time.perf_counter()
    kept = left(deadline) - reserve_s(options.time_limit_s) if deadline is not None else options.time_limit_s
    spare = max(0.05, min(max(MIN_REPLICA_S, REPLICA_SHARE * options.time_limit_s), kept))
    pair = solve_replicas(table, num_replicas=2, num_stages=options.num_stages, deadline=t0 + spare,
                          single=(None, True))
    settled = _settle_replicas(single_solver, True)
    if (pair is None or pair.num_replicas != 2) and time.perf_counter() >= t0 + spare:
        return None, single, settled, [
            f"The best two data-parallel replicas were not simulated against one pipeline: the replica search's proof "
            f"left {max(0.0, kept):.1f} s of planner.time_limit_s={options.time_limit_s:g} (raise it to have them "
            "simulated too)."]
    if pair is None or pair.num_replicas != 2:
        return None, single, settled, ["Two data-parallel replicas do not fit (each holds the whole model)."]
    pred, own = predict_replicas(table, pair.evaluations, pair.shares, pair.reduce_s)
    if pred.step_time_s >= single.step_time_s:
        return None, single, settled, [
            f"One pipeline is faster than data-parallel replicas: the best two replicas (shares "
            f"{'+'.join(map(str, pair.shares))}) predict {pred.step_time_s:.3g} s/step, "
            f"{_ratio(single.step_time_s / pred.step_time_s)} the throughput of this plan "
            f"({pair.reduce_s:.3g} s of it summing their gradients)."]
    # The closed form ranked one pipeline first, the simulator (whose numbers the plan reports) the
    # replicas: the plan never advises the slower of two placements it names, and says the question is open.
    why = ("the closed-form search ranks one pipeline first, but two replicas simulate faster; replica plans "
           "other than the best two were not simulated")
    report = _settle_replicas(single_solver, False, why, solver=f"{single_solver.solver} + replica search",
                              objective_s=pred.step_time_s, message=f"{single_solver.message}; replicas: "
                              f"{_replica_message(pair)}")
    return _replica_choice(table, pair, pred, own, single, report, why=(
        "By the solver's closed form one pipeline is faster; simulated, two replicas are faster and are planned."))


def _replica_choice(table: CostTable, solution: ReplicaSolution, prediction: Prediction, own: list[float],
                    single: Prediction, report: SolverReport, why: str = "",
                    ) -> tuple[Chosen, Prediction, SolverReport, list[str]]:
    """The replicas as (evaluation, share, own simulated step) with their prediction, report and verdict lines."""
    parts = [f"replica {r}: {len(ev.placement.devices)} stage(s), {m} of {table.num_micro_batches} micro-batches"
             for r, (ev, m) in enumerate(zip(solution.evaluations, solution.shares, strict=True))]
    note = [f"{solution.num_replicas} data-parallel pipeline replicas ({'; '.join(parts)}); their LoRA gradients "
            f"are summed at every step ({solution.reduce_s:.3g} s).",
            f"{_ratio(single.step_time_s / prediction.step_time_s)} the throughput of the best single pipeline "
            f"({single.step_time_s:.3g} s/step vs {prediction.step_time_s:.3g} s)."]
    return list(zip(solution.evaluations, solution.shares, own, strict=True)), prediction, report, note + (
        [why] if why else [])
