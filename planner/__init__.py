"""The planner: cost model, placement solvers (exact DP, ILP), schedules and simulator. Never imports torch."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from hetero.errors import ConfigError, InfeasiblePlanError
from hetero.graph import LayerGraph
from hetero.plan import Baseline, Plan, Prediction, ReplicaPlan, SolverReport, StagePlan, compute_input_hash
from hetero.planner.baselines import baseline_evaluations, candidate_placements, predict
from hetero.planner.cost import CostTable, build_cost_table, subtable
from hetero.planner.cost_model import CostModel, RooflineCostModel, compute_dtype
from hetero.planner.feasibility import check_single_nodes, explain_infeasible
from hetero.planner.objective import Evaluation, Placement, evaluate, split_spans
from hetero.planner.profile_cost import ProfileCostModel
from hetero.planner.replicas import ReplicaSolution, solve_replicas
from hetero.planner.schedules import gpipe, one_f_one_b, programs_for
from hetero.planner.simulator import ScheduleError, Timeline, combine_replicas, simulate, simulate_plan
from hetero.planner.solve import EXACT, solve
from hetero.program import format_program
from hetero.specs import ClusterSpec, DataSpec, EvalSpec, ModelSpec, PlannerOptions, TrainSpec

__all__ = [
    "CostModel", "RooflineCostModel", "ScheduleError", "Timeline", "gpipe", "one_f_one_b", "plan",
    "programs_for", "simulate", "simulate_plan",
]


def _manual(table: CostTable, graph: LayerGraph, options: PlannerOptions) -> Evaluation:
    """Validate planner.split / planner.devices and evaluate them with the same cost model."""
    names = [d.name for d in table.devices]
    order = options.devices or names
    unknown = [n for n in order if n not in names]
    if unknown:
        raise ConfigError(f"planner.devices names unknown device(s) {unknown}; the fleet has {names}")
    if len(set(order)) != len(order):
        raise ConfigError(f"planner.devices lists a device twice: {order}")
    dec = graph.decoder_indices()
    if options.split is None:
        # Devices without a split: spread the decoder layers evenly over them.
        base, rest = divmod(len(dec), len(order))
        split = [base + (1 if k < rest else 0) for k in range(len(order))]
    else:
        split = list(options.split)
        if options.devices is None:
            order = names[: len(split)]
    if len(split) != len(order):
        raise ConfigError(f"planner.split has {len(split)} stages but {len(order)} devices are given: {order}")
    if sum(split) != len(dec):
        raise ConfigError(f"planner.split={split} covers {sum(split)} decoder layers; the model has {len(dec)}")
    if any(c < 1 for c in split):
        raise ConfigError(f"planner.split={split}: every stage needs at least one decoder layer")
    if not dec or dec != list(range(dec[0], dec[0] + len(dec))):
        raise ConfigError(f"graph of '{graph.model_name}' has no contiguous decoder layers to split")
    spans = split_spans(len(graph.nodes), split, dec)
    ev = evaluate(table, Placement(tuple(names.index(n) for n in order), tuple(spans)))
    if not ev.feasible:
        how = {"none": " without recomputation (planner.recompute=none)", "full": " with every layer recomputing",
               "auto": " even with every layer recomputing"}[table.recompute_mode]
        raise InfeasiblePlanError(f"planner.split={split} does not fit{how}: " + "; ".join(ev.reasons))
    return ev


def recompute_layers(table: CostTable, graph: LayerGraph, ev: Evaluation, k: int) -> list[str]:
    """Names of stage k's recomputing layers: its first ``ev.recompute[k]`` recomputable nodes."""
    first, last = ev.placement.spans[k]
    count = ev.recompute[k] if ev.recompute else 0
    names = [graph.nodes[i].name for i in range(first, last + 1) if table.recomputable[i]]
    return names[:count]


def _verdict(prediction: Prediction, stages: list[StagePlan], base: list[Baseline], solver: SolverReport) -> list[str]:
    """Sentences a person reads: the prediction, the comparison, and when one device is enough."""
    step = prediction.step_time_s
    names = ", ".join(f"{s.device_type} ({s.device})" for s in stages)
    out = [f"Predicted {step:.3g} s/step ({prediction.tokens_per_s:,.0f} tokens/s) on {len(stages)} stage(s): "
           f"{names}; bubble {prediction.bubble_fraction:.0%}."]
    for b in base:
        if not b.feasible or b.prediction is None:
            out.append(f"{b.name}: not possible ({b.reason}).")
            continue
        other = b.prediction.step_time_s
        out.append(f"{other / step:.2f}x the throughput of {b.name.replace('_', ' ')} "
                   f"({b.description}: {other:.3g} s/step).")
    single = next((b for b in base if b.name == "best_single_device" and b.prediction), None)
    if single is not None and single.prediction is not None and len(stages) > 1:
        other = single.prediction.step_time_s
        if other <= step * 1.02:  # within 2%: the pipeline's extra machinery buys nothing
            out.append(f"A single {single.description.split(' (')[0]} is as fast ({other:.3g} s/step vs "
                       f"{step:.3g} s): use it alone.")
    if len(stages) == 1:
        out.append(f"The whole model fits and runs fastest on one device ({stages[0].device}): no pipeline needed.")
    if not solver.proven_optimal and solver.solver != "manual":
        gap = f" (gap {solver.gap:.1%})" if solver.gap is not None else ""
        out.append(f"The solver stopped before proving optimality{gap}: {solver.message}.")
    return out


def _simulated_best(table: CostTable, ev: Evaluation, prediction: Prediction,
                    pairs: list[tuple[Baseline, Evaluation | None]], num_stages: int | None,
                    ) -> tuple[Evaluation, Prediction, str]:
    """The plan never recommends a placement that simulates slower than a baseline it lists.

    The solver minimises the closed-form step time (objective.py); the plan reports the simulator's,
    which can rank two placements the other way round by a few percent. A baseline that is allowed
    under the plan's own settings (planner.recompute, planner.num_stages) and simulates faster is
    used instead, and the verdict says so."""
    best: tuple[Evaluation, Prediction, str] | None = None
    for b, bev in pairs:
        if bev is None or not b.feasible or (num_stages and len(bev.placement.devices) != num_stages):
            continue
        own = evaluate(table, Placement(bev.placement.devices, bev.placement.spans))  # the plan's recompute mode
        if not own.feasible:
            continue
        pred, _ = predict(table, own)
        if pred.step_time_s < (best[1] if best else prediction).step_time_s * (1 - 1e-9):
            best = (own, pred, b.name.replace("_", " "))
    if best is None:
        return ev, prediction, ""
    own, pred, name = best
    return own, pred, (f"The solver's optimum of the closed-form step time simulates at {prediction.step_time_s:.3g} "
                       f"s/step; the {name} placement simulates faster ({pred.step_time_s:.3g} s) and is the "
                       "one planned.")


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


# Of planner.time_limit_s, the unforced replica search (and the two-replica comparison) may use this share.
REPLICA_SHARE = 0.2


def _ratio(x: float) -> str:
    """1.24x; 1.004x where two decimals would round a real difference away."""
    return f"{x:.3f}x" if abs(x - 1) < 0.01 else f"{x:.2f}x"


def _replicas(table: CostTable, options: PlannerOptions, single: Prediction, single_solver: SolverReport,
              ) -> tuple[list[tuple[Evaluation, int, float]] | None, Prediction, SolverReport, list[str]]:
    """Data x pipeline replicas when they simulate faster than the one pipeline (or planner.replicas asks
    for them): the replicas with their shares (None: keep the one pipeline), the prediction, the solver
    report and the verdict lines (which also say what the best replicas would have given)."""
    t0 = time.perf_counter()
    forced = options.replicas
    left = max(0.5, options.time_limit_s - single_solver.solve_time_s)
    # Unforced, replicas are an option the search may leave unproven: it gets a share of the limit, so a
    # fleet whose replicas cannot be proven does not make every compile wait for the whole limit.
    budget = left if forced is not None else min(left, max(2.0, REPLICA_SHARE * options.time_limit_s))
    solution = solve_replicas(table, budget, max_replicas=forced, num_replicas=forced, num_stages=options.num_stages)
    if forced is not None and (solution is None or solution.num_replicas != forced):
        raise InfeasiblePlanError(f"planner.replicas={forced}: no {forced} replicas of the model fit on this fleet "
                                  f"(each replica holds the whole model on its own devices)")
    if (solution is not None and solution.num_replicas < 2 and solution.proven_optimal and table.num_devices >= 2
            and table.num_micro_batches >= 2):
        # One pipeline wins (proven): say by how much over the best two replicas, in a bounded time.
        spare = max(0.5, min(REPLICA_SHARE * options.time_limit_s, options.time_limit_s - single_solver.solve_time_s
                             - (time.perf_counter() - t0)))
        pair = solve_replicas(table, spare, num_replicas=2, num_stages=options.num_stages)
        if pair is None or pair.num_replicas != 2:
            return None, single, single_solver, ["Two data-parallel replicas do not fit (each holds the whole model)."]
        pred, own = predict_replicas(table, pair.evaluations, pair.shares, pair.reduce_s)
        if pred.step_time_s >= single.step_time_s:
            return None, single, single_solver, [
                f"One pipeline is faster than data-parallel replicas: the best two replicas (shares "
                f"{'+'.join(map(str, pair.shares))}) predict {pred.step_time_s:.3g} s/step, "
                f"{_ratio(single.step_time_s / pred.step_time_s)} the throughput of this plan "
                f"({pair.reduce_s:.3g} s of it summing their gradients)."]
        # The closed form ranked one pipeline first, the simulator (whose numbers the plan reports) the
        # replicas: the plan never advises the slower of two placements it names.
        return _replica_choice(table, pair, pred, own, single, single_solver, why=(
            f"The solver's closed form ranks one pipeline first ({pair.single.step_time_s if pair.single else 0:.3g} "
            f"vs {pair.step_time_s:.3g} s/step for two replicas); simulated, two replicas are faster and are "
            "planned."))
    if solution is None or solution.num_replicas < 2:
        unproven = solution is not None and not solution.proven_optimal and single_solver.proven_optimal
        return None, single, single_solver, [
            f"Data-parallel replicas were searched for {budget:.3g} s without proving whether any beat one "
            f"pipeline ({solution.message if solution else ''}); raise planner.time_limit_s to settle it."
        ] if unproven else []
    prediction, own = predict_replicas(table, solution.evaluations, solution.shares, solution.reduce_s)
    if forced is None and prediction.step_time_s >= single.step_time_s:
        return None, single, single_solver, [
            f"Replicas ({solution.num_replicas}, shares {'+'.join(map(str, solution.shares))}) win by the closed "
            f"form but simulate at {prediction.step_time_s:.3g} s/step against {single.step_time_s:.3g} s: one "
            "pipeline is planned."]
    report = SolverReport(EXACT + " (replicas)", "Optimal" if solution.proven_optimal else "Not Solved",
                          "Optimal Solution Found" if solution.proven_optimal else "Solution Found",
                          solution.proven_optimal, 0.0 if solution.proven_optimal else None, solution.step_time_s,
                          single_solver.solve_time_s + time.perf_counter() - t0, options.time_limit_s,
                          message=solution.message)
    return _replica_choice(table, solution, prediction, own, single, report)


def _replica_choice(table: CostTable, solution: ReplicaSolution, prediction: Prediction, own: list[float],
                    single: Prediction, report: SolverReport, why: str = "",
                    ) -> tuple[list[tuple[Evaluation, int, float]], Prediction, SolverReport, list[str]]:
    """The replicas as (evaluation, share, own simulated step) with their prediction, report and verdict lines."""
    parts = [f"replica {r}: {len(ev.placement.devices)} stage(s), {m} of {table.num_micro_batches} micro-batches"
             for r, (ev, m) in enumerate(zip(solution.evaluations, solution.shares, strict=True))]
    note = [f"{solution.num_replicas} data-parallel pipeline replicas ({'; '.join(parts)}); their LoRA gradients "
            f"are summed at every step ({solution.reduce_s:.3g} s).",
            f"{_ratio(single.step_time_s / prediction.step_time_s)} the throughput of the best single pipeline "
            f"({single.step_time_s:.3g} s/step vs {prediction.step_time_s:.3g} s)."]
    return list(zip(solution.evaluations, solution.shares, own, strict=True)), prediction, report, note + (
        [why] if why else [])


def _training_fleet(cluster: ClusterSpec, evaluation: EvalSpec) -> ClusterSpec:
    """The fleet less the evaluation device, which evaluates held-out data and does not train."""
    if evaluation.device is None:
        return cluster
    return replace(cluster, hosts=[replace(h, devices=[d for d in h.devices if d.name != evaluation.device])
                                   for h in cluster.hosts])


def _place(table: CostTable, graph: LayerGraph, model: ModelSpec, options: PlannerOptions,
           ) -> tuple[Evaluation, SolverReport]:
    """The manual split when planner.split/devices are given, else the solver's placement (or why none fits)."""
    limit = min(len(table.devices), len(graph.nodes))
    if options.num_stages is not None and not 1 <= options.num_stages <= limit:
        raise ConfigError(f"planner.num_stages={options.num_stages}: choose 1..{limit} "
                          f"({len(table.devices)} devices, {len(graph.nodes)} layer-graph nodes)")
    if options.split is not None or options.devices is not None:
        ev = _manual(table, graph, options)
        return ev, SolverReport("manual", "Manual", "manual split", False, None, ev.step_time_s, 0.0,
                                options.time_limit_s, message="planner.split/devices given: the solver was not run")
    check_single_nodes(table, graph)
    result = solve(table, options.num_stages, options.time_limit_s, starts=candidate_placements(table, graph))
    if result.evaluation is None:
        if result.report.status == "Infeasible" or result.report.sol_status == "No Solution Exists":
            raise InfeasiblePlanError(explain_infeasible(table, graph, model, options.num_stages))
        raise InfeasiblePlanError(f"the solver found no placement within planner.time_limit_s="
                                  f"{options.time_limit_s:g}: raise it or set planner.num_stages")
    return result.evaluation, result.report


Chosen = list[tuple[Evaluation, int, float]]  # per pipeline replica: its placement, micro-batches, own step time


def _choose(table: CostTable, options: PlannerOptions, ev: Evaluation, solver: SolverReport,
            pairs: list[tuple[Baseline, Evaluation | None]]) -> tuple[Chosen, Prediction, SolverReport, list[str]]:
    """What to plan: the placement (or a baseline that simulates faster), or data x pipeline replicas when
    they win; with its prediction, solver report and the verdict lines that say why."""
    prediction, _ = predict(table, ev)
    adopted = ""
    auto = options.split is None and options.devices is None
    if auto:
        ev, prediction, adopted = _simulated_best(table, ev, prediction, pairs, options.num_stages)
    chosen: Chosen = [(ev, table.num_micro_batches, prediction.step_time_s)]
    replica_note: list[str] = []
    if auto and options.replicas != 1 and (options.num_stages is None or options.replicas is not None):
        picked, prediction, solver, replica_note = _replicas(table, options, prediction, solver)
        if picked is not None:
            chosen, adopted = picked, ""
    return chosen, prediction, solver, replica_note + ([adopted] if adopted else [])


def _stage_plan(table: CostTable, graph: LayerGraph, model: ModelSpec, cluster: ClusterSpec, ev: Evaluation,
                pos: int, k: int, program: list[str]) -> StagePlan:
    """Stage k, position ``pos`` of its pipeline's placement: where it runs, what it holds, its predicted costs."""
    dev = table.devices[ev.placement.devices[pos]]
    first, last = ev.placement.spans[pos]
    host = cluster.host(dev.host)
    return StagePlan(
        index=k, host=dev.host, device=dev.name, device_type=dev.type, backend=dev.backend,
        dtype=compute_dtype(dev, model), quantization=dev.quantization(model.quantization),
        first_node=first, last_node=last, node_names=[n.name for n in graph.nodes[first:last + 1]],
        endpoint=f"tcp://{host.address}:{host.port + k}", threads=dev.threads,
        fwd_time_s=ev.fwd_s[pos], bwd_time_s=ev.bwd_s[pos], send_time_s=ev.send_s[pos],
        memory=ev.memory[pos], program=program, artifact=f"artifacts/{dev.host}/stage{k}",
        overhead_s=dict(ev.overhead_s[pos]) if ev.overhead_s else {},
        step_sync_s=ev.sync_s[pos] if ev.sync_s else 0.0,
        recompute_layers=recompute_layers(table, graph, ev, pos),
        recompute_time_s=ev.recompute_s[pos] if ev.recompute_s else 0.0,
    )


def _stages(table: CostTable, graph: LayerGraph, model: ModelSpec, cluster: ClusterSpec, schedule: str,
            chosen: Chosen) -> tuple[list[StagePlan], list[ReplicaPlan]]:
    """Every replica's stages with their programs, numbered in order, and the replicas that group them."""
    stages: list[StagePlan] = []
    replicas: list[ReplicaPlan] = []
    for ev, share, own_step in chosen:
        programs = programs_for(schedule, len(ev.placement.devices), share)
        first_stage = len(stages)
        for pos in range(len(ev.placement.devices)):
            stages.append(_stage_plan(table, graph, model, cluster, ev, pos, len(stages),
                                      format_program(programs[pos])))
        replicas.append(ReplicaPlan(list(range(first_stage, len(stages))), share,
                                    sum(m for _, m, _ in chosen[:len(replicas)]), own_step))
    return stages, replicas


def _cost_provenance(cost_model: CostModel) -> tuple[dict[str, str], list[str]]:
    """Where a measured profile's numbers went (plan.cost_sources) and the verdict's line on it; none from
    datasheets alone."""
    if not isinstance(cost_model, ProfileCostModel):
        return {}, []
    return {"profile": cost_model.path, **cost_model.sources}, cost_model.summary()


def plan(
    model: ModelSpec,
    graph: LayerGraph,
    cluster: ClusterSpec,
    train: TrainSpec,
    data: DataSpec,
    options: PlannerOptions,
    cost_model: CostModel | None = None,
    evaluation: EvalSpec | None = None,
    config: dict[str, Any] | None = None,
) -> Plan:
    """The complete, hashed Plan: the graph placed on the fleet (planner.solve: exact DP or ILP; or the manual
    split), programs, predictions, baselines and verdict. ``evaluation.device`` is kept out of training (it
    evaluates held-out data); ``config`` is the resolved config the plan records."""
    cost_model = cost_model or RooflineCostModel(efficiency=options.efficiency)
    evaluation = evaluation or EvalSpec()
    table = build_cost_table(graph, model, _training_fleet(cluster, evaluation), train, options, cost_model)
    ev, solver = _place(table, graph, model, options)
    pairs = baseline_evaluations(table, graph.decoder_indices())
    chosen, prediction, solver, notes = _choose(table, options, ev, solver, pairs)
    stages, replicas = _stages(table, graph, model, cluster, train.schedule, chosen)
    base = [b for b, _ in pairs]
    cost_sources, cost_notes = _cost_provenance(cost_model)
    unhashed = Plan(
        model=model, cluster=cluster, train=train, data=data, planner=options, graph=graph, stages=stages,
        prediction=prediction, baselines=base, solver=solver,
        verdict=_verdict(prediction, stages, base, solver) + notes + cost_notes, config=dict(config or {}),
        cost_sources=cost_sources, eval=evaluation, replicas=replicas if len(replicas) > 1 else [],
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    return replace(unhashed, input_hash=compute_input_hash(unhashed))
