"""``plan()``: the one screen that composes the planner's wings into a Plan.

It prices the graph on the fleet (model/), places it (search/: the exact DP, the ILP, the simulated search; or the
manual split), weighs replicas (replica/), checks the result against the baselines it lists (explain/), and writes
the stages' programs (schedule/) and the verdict (explain/verdict.py). Only replan/ (re-planning a run) sits
above it. Never imports torch."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from hetero.errors import ConfigError, InfeasiblePlanError
from hetero.graph import LayerGraph
from hetero.plan import (
    Baseline,
    DataStats,
    Plan,
    Prediction,
    ReplicaPlan,
    SolverReport,
    StagePlan,
    compute_input_hash,
    with_label_fraction,
)
from hetero.planner.explain.baselines import baseline_evaluations, candidate_placements
from hetero.planner.explain.caveats import issue_bound_lines, stage_eval_lines
from hetero.planner.explain.compress_advice import link_lines
from hetero.planner.explain.feasibility import check_single_nodes, explain_infeasible
from hetero.planner.explain.verdict import (
    cipher_lines,
    cost_provenance,
    experts_lines,
    unused_lines,
    verdict_lines,
)
from hetero.planner.model.cost import GB, CostTable, build_cost_table, link_scheme, training_fleet
from hetero.planner.model.cost_model import CostModel, RooflineCostModel, compute_dtype, expert_weight_bytes
from hetero.planner.model.objective import (
    Evaluation,
    Placement,
    evaluate,
    ram_may_bind,
    resident_weights,
    split_spans,
)
from hetero.planner.model.predict import predict
from hetero.planner.model.profile_cost import ProfileCostModel
from hetero.planner.model.state_copy import state_copy
from hetero.planner.replica.replica_choice import (
    Chosen,
    searches_replicas,
    settle,
    settle_single,
)
from hetero.planner.replica.replica_choice import choose_replicas as _replicas
from hetero.planner.schedule.step_form import programs_for
from hetero.planner.search.deadline import INTERLEAVE_SHARE, PLACE_SHARE, reserve_s, share_of
from hetero.planner.search.interleave import interleave
from hetero.planner.search.solve import PROVEN, solve_simulated
from hetero.program import format_program, parse_program
from hetero.specs import ClusterSpec, DataSpec, EvalSpec, ModelSpec, PlannerOptions, TrainSpec
from hetero.stream_buffer import copies_per_step


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


def stream_layers(table: CostTable, graph: LayerGraph, ev: Evaluation, k: int) -> list[str]:
    """Names of stage k's streamed layers: its last ``ev.stream[k]`` streamable (decoder) nodes."""
    first, last = ev.placement.spans[k]
    count = ev.stream[k] if ev.stream else 0
    names = [graph.nodes[i].name for i in range(first, last + 1) if table.streamable[i]]
    return names[len(names) - count:] if count else []


def streamed_bytes_per_step(table: CostTable, graph: LayerGraph, ev: Evaluation, k: int, program: list[str]) -> float:
    """Bytes stage k copies host-to-device per step (after its first) running ``program``: each streamed layer's
    frozen weights times its copies under the runtime's two-layer buffer (hetero/stream_buffer.py; a layer still
    resident at a turn from forward to backward, or re-run by recomputation, is not copied again)."""
    d = ev.placement.devices[k]
    streamed = set(stream_layers(table, graph, ev, k))
    layers = [i for i, n in enumerate(graph.nodes) if n.name in streamed]
    copies = copies_per_step([a.op.value for a in parse_program(program)], layers)
    return sum(table.stream_bytes[i][d] * copies[i] for i in layers)


def _simulated_best(table: CostTable, ev: Evaluation, prediction: Prediction,
                    pairs: list[tuple[Baseline, Evaluation | None]], num_stages: int | None,
                    ) -> tuple[Evaluation, Prediction, str]:
    """The plan never recommends a placement that simulates slower than a baseline it lists.

    The solver ranks by the simulated step time (planner.search.solve.solve_simulated) and its candidates
    include the baselines' splits, so this only acts when its search was cut off. A baseline that is
    allowed under the plan's own settings (planner.recompute, planner.num_stages) and simulates faster
    is used instead, and the verdict says so."""
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
    return own, pred, (f"The solver's placement simulates at {prediction.step_time_s:.3g} s/step; the {name} "
                       f"placement simulates faster ({pred.step_time_s:.3g} s) and is the one planned.")


def _place(table: CostTable, graph: LayerGraph, model: ModelSpec, options: PlannerOptions,
           deadline: float | None = None) -> tuple[Evaluation, SolverReport]:
    """The manual split when planner.split/devices are given, else the solver's placement (or why none fits),
    found by ``deadline`` less what the replica search and the rest of the plan need."""
    limit = min(len(table.devices), len(graph.nodes))
    if options.num_stages is not None and not 1 <= options.num_stages <= limit:
        raise ConfigError(f"planner.num_stages={options.num_stages}: choose 1..{limit} "
                          f"({len(table.devices)} devices, {len(graph.nodes)} layer-graph nodes)")
    if options.split is not None or options.devices is not None:
        ev = _manual(table, graph, options)
        return ev, SolverReport("manual", "Manual", "manual split", False, None, ev.step_time_s, 0.0,
                                options.time_limit_s, message="planner.split/devices given: the solver was not run")
    check_single_nodes(table, graph)
    deadline = time.perf_counter() + options.time_limit_s if deadline is None else deadline
    end = share_of(deadline, PLACE_SHARE if searches_replicas(options, table) else 1.0, reserve_s(options.time_limit_s))
    result = solve_simulated(table, options.num_stages, max(0.05, end - time.perf_counter()),
                             starts=candidate_placements(table, graph), deadline=end)
    if result.evaluation is None:
        if result.report.status == "Infeasible" or result.report.sol_status == "No Solution Exists":
            raise InfeasiblePlanError(explain_infeasible(table, graph, model, options.num_stages))
        if ram_may_bind(table):
            raise InfeasiblePlanError(
                f"the solver found no placement within planner.time_limit_s={options.time_limit_s:g}: host RAM "
                "(ram_gb) may be short of what the stages stream, and the RAM-aware search (the ILP over every "
                "stream/recompute trade) is slow: raise planner.time_limit_s (Llama-70B on two cards: about 600) "
                "or ram_gb")
        raise InfeasiblePlanError(f"the solver found no placement within planner.time_limit_s="
                                  f"{options.time_limit_s:g}: raise it or set planner.num_stages")
    return result.evaluation, settle_single(result.report, options, table)


def _choose(table: CostTable, graph: LayerGraph, model: ModelSpec, cluster: ClusterSpec, schedule: str,
            options: PlannerOptions, ev: Evaluation, solver: SolverReport,
            pairs: list[tuple[Baseline, Evaluation | None]], deadline: float | None = None,
            ) -> tuple[Chosen, Prediction, SolverReport, list[str], list[StagePlan] | None]:
    """What to plan: the placement (or a baseline that simulates faster), in the schedule's chunked form where
    that simulates faster (planner/search/interleave.py), or data x pipeline replicas where they beat it; with its
    prediction, solver report, the verdict lines that say why, and the one pipeline's stages (None: replicas)."""
    prediction, _ = predict(table, ev)
    adopted = ""
    auto = options.split is None and options.devices is None
    if auto:
        ev, prediction, adopted = _simulated_best(table, ev, prediction, pairs, options.num_stages)
        if not adopted and solver.proven_optimal and solver.message.startswith(PROVEN):
            # What the proof covers (docs/reading-a-plan.md): the single pipeline's placement; replicas say their own.
            adopted = f"Placement proven {solver.message}."
    chosen: Chosen = [(ev, table.num_micro_batches, prediction.step_time_s)]
    stages, _ = _stages(table, graph, model, cluster, schedule, chosen, options.compression)
    end = share_of(deadline, INTERLEAVE_SHARE) if searches_replicas(options, table) and deadline is not None else deadline
    stages, best, said = interleave(table, graph, model, ev, stages, prediction, options.interleave, not auto, end,
                                    options.compression)
    notes = ([adopted] if adopted else []) + ([said] if said else [])
    if (auto and options.replicas != 1 and options.interleave != "always"
            and (options.num_stages is None or options.replicas is not None)):
        # Replicas are weighed against the best one pipeline: interleaved where that simulated faster.
        picked, replicated, solver, replica_note = _replicas(table, options, best, solver, ev, deadline)
        if picked is not None:
            return picked, replicated, solver, replica_note + ([
                f"They beat one pipeline interleaved ({best.step_time_s:.3g} s/step; one chunk per device: "
                f"{prediction.step_time_s:.3g} s)."] if any(s.chunks for s in stages) else []), None
        notes = replica_note + notes
    return chosen, best, solver, notes, stages


def _stage_plan(table: CostTable, graph: LayerGraph, model: ModelSpec, cluster: ClusterSpec, ev: Evaluation,
                pos: int, k: int, program: list[str]) -> StagePlan:
    """Stage k, position ``pos`` of its pipeline's placement, running ``program``: where it runs, what
    it holds, its predicted costs."""
    dev = table.devices[ev.placement.devices[pos]]
    streams = bool(ev.stream and ev.stream[pos])
    first, last = ev.placement.spans[pos]
    host = cluster.host(dev.host)
    return StagePlan(
        index=k, host=dev.host, device=dev.name, device_type=dev.type, backend=dev.backend,
        dtype=compute_dtype(dev, model), quantization=dev.quantization(model.quantization),
        first_node=first, last_node=last, node_names=[n.name for n in graph.nodes[first:last + 1]],
        endpoint=f"tcp://{host.address}:{host.port + k}", threads=dev.threads,
        fwd_time_s=ev.fwd_s[pos], bwd_time_s=ev.bwd_s[pos], send_time_s=ev.send_s[pos],
        memory=replace(ev.memory[pos], experts_gb=sum(expert_weight_bytes(graph, i, dev, model)
                                                      for i in range(first, last + 1)) / GB),
        program=program, artifact=f"artifacts/{dev.host}/stage{k}",
        overhead_s=dict(ev.overhead_s[pos]) if ev.overhead_s else {},
        step_sync_s=ev.sync_s[pos] if ev.sync_s else 0.0,
        recompute_layers=recompute_layers(table, graph, ev, pos),
        recompute_time_s=ev.recompute_s[pos] if ev.recompute_s else 0.0,
        stream_layers=stream_layers(table, graph, ev, pos),
        stream_time_s=ev.stream_s[pos] if streams else 0.0,
        streamed_bytes_per_step=streamed_bytes_per_step(table, graph, ev, pos, program) if streams else 0.0,
        frozen_resident_cap_bytes=resident_weights(
            table, ev.placement.devices[pos], sum(table.weights[i][ev.placement.devices[pos]] for i in range(first, last + 1)),
            ev.stream_bytes[pos], ev.stream[pos]) if streams else 0.0,
    )


def _stages(table: CostTable, graph: LayerGraph, model: ModelSpec, cluster: ClusterSpec, schedule: str,
            chosen: Chosen, compression: str = "none") -> tuple[list[StagePlan], list[ReplicaPlan]]:
    """Every replica's stages with their programs, numbered in order, and the replicas that group them."""
    stages: list[StagePlan] = []
    replicas: list[ReplicaPlan] = []
    for ev, share, own_step in chosen:
        programs = programs_for(schedule, len(ev.placement.devices), share)
        first_stage = len(stages)
        for pos in range(len(ev.placement.devices)):
            stage = _stage_plan(table, graph, model, cluster, ev, pos, len(stages), format_program(programs[pos]))
            scheme = "none" if pos == len(ev.placement.devices) - 1 else _link_scheme(table, ev, pos, compression)
            stages.append(stage if scheme == "none" else replace(stage, compress_out=scheme))
        replicas.append(ReplicaPlan(list(range(first_stage, len(stages))), share,
                                    sum(m for _, m, _ in chosen[:len(replicas)]), own_step))
    return stages, replicas


def _link_scheme(table: CostTable, ev: Evaluation, pos: int, compression: str) -> str:
    """What the link after position ``pos`` of a placement carries (planner/model/cost.py link_scheme)."""
    return link_scheme(table, compression, ev.placement.spans[pos][1], ev.placement.devices[pos],
                       ev.placement.devices[pos + 1])


def _check_attention_devices(model: ModelSpec, stages: list[StagePlan]) -> None:
    """flash-attn and flex attention train on GPUs only: refuse a plan that puts a stage elsewhere, in one line."""
    if model.attn_implementation not in ("flash_attention_2", "flex_attention"):
        return
    off = next((s for s in stages if s.backend not in ("cuda", "rocm")), None)
    if off is not None:
        raise ConfigError(f"model.attn_implementation={model.attn_implementation} trains on CUDA/ROCm GPUs only, and "
                          f"stage {off.index} runs on {off.device} ({off.backend}); use auto, sdpa or eager")


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
    data_stats: DataStats | None = None,
    security: str = "none",
) -> Plan:
    """The complete, hashed Plan: the graph placed on the fleet (planner.search.solve: exact DP or ILP; or the manual
    split), programs, predictions, baselines and verdict. ``evaluation.device`` is kept out of training (it
    evaluates held-out data); ``config`` is the resolved config the plan records; ``data_stats`` (the data as
    `hetero compile` measured it) turns the predictions' computed tokens/s into trained tokens/s; ``security``: the
    mode the plan's processes talk in (curve prices the cipher on every link not measured)."""
    cost_model = cost_model or RooflineCostModel(efficiency=options.efficiency, security=security)
    if isinstance(cost_model, ProfileCostModel):  # the cores a run's shared-core hosts gave, the RAM they have
        cluster = cost_model.with_measured_hosts(cluster)
    evaluation = evaluation or EvalSpec()
    deadline = time.perf_counter() + options.time_limit_s  # the whole plan's, once: every search ends by it
    trains = training_fleet(cluster, evaluation.device, *options.exclude)
    table = build_cost_table(graph, model, trains, train, options, cost_model)
    ev, solver = _place(table, graph, model, options, deadline)
    pairs = baseline_evaluations(table, graph.decoder_indices())
    chosen, prediction, solver, notes, one = _choose(table, graph, model, cluster, train.schedule, options, ev, solver,
                                                     pairs, deadline)
    solver = settle(solver, options, table)
    stages, replicas = _stages(table, graph, model, cluster, train.schedule, chosen, options.compression)
    if one is not None:  # one pipeline, interleaved where that won
        stages = one
        notes += link_lines(table, cluster, chosen[0][0], options.compression, any(s.chunks for s in stages))
    _check_attention_devices(model, stages)
    fraction = data_stats.label_fraction if data_stats is not None else None
    copy = state_copy(stages, graph, cluster, prediction.step_time_s, replicas[0].stages if replicas else None)
    prediction = replace(with_label_fraction(prediction, fraction), state_copy_bytes=copy.bytes,
                         state_copy_s=copy.seconds, state_copy_every=copy.every)
    base = [replace(b, prediction=with_label_fraction(b.prediction, fraction)) if b.prediction is not None else b
            for b, _ in pairs]
    cost_sources, cost_notes = cost_provenance(cost_model)
    head = [*verdict_lines(prediction, stages, base, solver), *notes, *cost_notes]
    tail = [*issue_bound_lines(stages, cost_model), *experts_lines(graph, cost_model, model),
            *(cost_model.loaded_lines(stages, prediction.stage_busy) if isinstance(cost_model, ProfileCostModel) else []),
            *unused_lines(trains, stages, options),
            *stage_eval_lines(evaluation, stages, replicas if len(replicas) > 1 else [], train, prediction.step_time_s)]
    unhashed = Plan(
        model=model, cluster=cluster, train=train, data=data, planner=options, graph=graph, stages=stages,
        prediction=prediction, baselines=base, solver=solver, verdict=[*head, *tail], config=dict(config or {}),
        cost_sources=cost_sources, eval=evaluation, replicas=replicas if len(replicas) > 1 else [],
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), data_stats=data_stats,
    )
    unhashed = replace(unhashed, verdict=[*head, *cipher_lines(cost_model, unhashed), *tail])
    return replace(unhashed, input_hash=compute_input_hash(unhashed))
