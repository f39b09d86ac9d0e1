"""Baselines a plan is compared with, and the simulator-based prediction of any placement."""

from __future__ import annotations

from hetero.plan import Baseline, Prediction
from hetero.planner.model.cost import GB, CostTable
from hetero.planner.model.objective import Evaluation, Placement, evaluate, split_spans
from hetero.planner.model.predict import predict

# Baselines recompute whatever layers make them fit, as a single-GPU trainer with gradient
# checkpointing would, whatever planner.recompute says for the plan itself: a baseline that
# "does not fit" only because it may not recompute would flatter the plan.
BASELINE_RECOMPUTE = "auto"
# They stream frozen weights from host RAM as planner.offload allows the plan (a single-GPU trainer with CPU
# offload of the base weights; hosts without ram_gb cannot): the same rule, the same prices.


def layer_counts(evaluation: Evaluation, decoder_indices: list[int]) -> list[int]:
    """Decoder layers per stage of a placement."""
    dec = set(decoder_indices)
    return [sum(1 for i in range(a, b + 1) if i in dec) for a, b in evaluation.placement.spans]


def proportional_counts(weights: list[float], total: int) -> list[int] | None:
    """Split ``total`` layers in proportion to ``weights``, at least one each (largest remainder)."""
    if total < len(weights) or not weights:
        return None
    share = sum(weights)
    extra = total - len(weights)  # one layer each first, the rest proportionally
    raw = [extra * w / share for w in weights]
    counts = [int(r) for r in raw]
    order = sorted(range(len(weights)), key=lambda k: raw[k] - counts[k], reverse=True)
    for k in order[: extra - sum(counts)]:
        counts[k] += 1
    return [c + 1 for c in counts]


def _split_baseline(
    table: CostTable, decoder_indices: list[int], name: str, description: str, counts: list[int] | None
) -> tuple[Baseline, Evaluation | None]:
    names = [d.name for d in table.devices]
    if counts is None:
        return Baseline(name, description, False, f"{len(names)} devices but only {len(decoder_indices)} decoder "
                        "layers: every stage needs one", names), None
    spans = split_spans(table.num_nodes, counts, decoder_indices)
    ev = evaluate(table, Placement(tuple(range(len(names))), tuple(spans)), mode=BASELINE_RECOMPUTE)
    if not ev.feasible:
        return Baseline(name, description, False, "; ".join(ev.reasons), names, counts), ev
    prediction, _ = predict(table, ev)
    return Baseline(name, description + _recompute_note(ev), True, "", names, counts, prediction), ev


def single_device_baseline(table: CostTable, num_decoders: int) -> tuple[Baseline, Evaluation | None]:
    """The fastest device that holds the whole model alone."""
    best: tuple[Prediction, Evaluation] | None = None
    smallest_need = float("inf")
    for d in range(len(table.devices)):
        ev = evaluate(table, Placement((d,), ((0, table.num_nodes - 1),)), mode=BASELINE_RECOMPUTE)
        smallest_need = min(smallest_need, ev.memory[0].total_gb)
        if not ev.feasible:
            continue
        prediction, _ = predict(table, ev)
        if best is None or prediction.step_time_s < best[0].step_time_s:
            best = (prediction, ev)
    name = "best_single_device"
    if best is None:
        largest = max(table.usable_bytes) / GB
        return Baseline(name, "the fastest single device that holds the whole model", False,
                        f"no single device holds the whole model, even recomputing every layer"
                        f"{' and streaming' if any(table.can_stream) and table.stream_mode != 'none' else ''} (needs "
                        f"{smallest_need:.1f} GB, the largest has {largest:.1f} GB usable)"), None
    prediction, ev = best
    dev = table.devices[ev.placement.devices[0]]
    return Baseline(name, f"{dev.display_name} ({dev.name}) alone{_recompute_note(ev)}", True, "", [dev.name],
                    [num_decoders], prediction), ev


def _recompute_note(ev: Evaluation) -> str:
    """", recomputing N layers" when the baseline needs recomputation to fit, ", streaming M from host RAM"
    when it needs streaming."""
    count = sum(ev.recompute) if ev.recompute else 0
    streams = sum(ev.stream) if ev.stream else 0
    return ((f", recomputing {count} layer{'s' if count != 1 else ''}" if count else "")
            + (f", streaming {streams} from host RAM" if streams else ""))


def baselines(table: CostTable, decoder_indices: list[int]) -> list[Baseline]:
    """Best single device, even split over the fleet, TFLOPS-proportional split over the fleet."""
    return [b for b, _ in baseline_evaluations(table, decoder_indices)]


def baseline_evaluations(table: CostTable, decoder_indices: list[int]) -> list[tuple[Baseline, Evaluation | None]]:
    """The baselines with their evaluations (None where a baseline cannot be built)."""
    num_dev, num_dec = len(table.devices), len(decoder_indices)
    single, single_ev = single_device_baseline(table, num_dec)
    even = proportional_counts([1.0] * num_dev, num_dec)
    tflops = [d.tflops.get(d.compute_dtype(table.model_dtype), 0.0) or d.tflops.get("float32", 0.0) for d in table.devices]
    prop = proportional_counts(tflops, num_dec) if all(t > 0 for t in tflops) else None
    even_b, even_ev = _split_baseline(table, decoder_indices, "even_split",
                                      "all devices in fleet order, decoder layers split evenly", even)
    prop_b, prop_ev = _split_baseline(table, decoder_indices, "tflops_proportional",
                                      "all devices in fleet order, decoder layers in proportion to TFLOPS", prop)
    return [(single, single_ev), (even_b, even_ev), (prop_b, prop_ev)]


def candidate_placements(table: CostTable, graph_or_none: object = None) -> list[Placement]:
    """Heuristic placements that seed the ILP: each device alone, even and TFLOPS splits, and the
    TFLOPS split over every prefix of the devices sorted fastest first."""
    decoder = [i for i in range(table.num_nodes)]
    graph = graph_or_none
    if graph is not None and hasattr(graph, "decoder_indices"):
        decoder = graph.decoder_indices()
    nd = table.num_devices
    out = [Placement((d,), ((0, table.num_nodes - 1),)) for d in range(nd)]
    if table.devices:
        tflops = [d.tflops.get(d.compute_dtype(table.model_dtype), 0.0) or d.tflops.get("float32", 0.0)
                  for d in table.devices]
    else:  # a table without a fleet: speed is the inverse of the device's whole-model time
        tflops = [1.0 / max(1e-30, sum(table.fwd_s[i][d] + table.bwd_s[i][d] for i in range(table.num_nodes)))
                  for d in range(nd)]
    fastest = sorted(range(nd), key=lambda d: -tflops[d])
    for orders in (list(range(nd)), fastest):
        for s in range(2, len(orders) + 1):
            devs = orders[:s]
            for weights in ([1.0] * s, [tflops[d] or 1.0 for d in devs]):
                counts = proportional_counts(weights, len(decoder))
                if counts:
                    out.append(Placement(tuple(devs), tuple(split_spans(table.num_nodes, counts, decoder))))
    return out
