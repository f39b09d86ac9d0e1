"""The run report's comparison: measured vs predicted per-stage compute, transfer wait and idle time.

Call at the end of `hetero run` with the plan, the metrics.jsonl lines and the per-stage op timings;
it returns lines for the report and flags any stage more than 20% off its prediction. Torch-free and
planner-free (the runtime never imports pulp): predictions are read from the plan's own numbers.
"""

from __future__ import annotations

import statistics
from typing import Any

from hetero.hints import suggest
from hetero.plan import Plan

OFF_BY = 0.20  # a stage more than 20% off its prediction is flagged


def stage_timings_from_metrics(metrics: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Median per-op seconds per stage over the steps (the first step is left out: it warms up)."""
    steps = metrics[1:] if len(metrics) > 1 else metrics
    if not steps or "stage_ops" not in steps[0]:
        return []
    out = []
    for k in range(len(steps[0]["stage_ops"])):
        ops = {op for s in steps for op in s["stage_ops"][k]}
        out.append({op: statistics.median(float(s["stage_ops"][k].get(op, 0.0)) for s in steps) for op in sorted(ops)})
    return out


def median_step_s(metrics: list[dict[str, Any]]) -> float:
    """The run's measured step time: the median over its steps, the first (warm-up) left out when possible."""
    steps = metrics[1:] if len(metrics) > 1 else metrics
    return statistics.median(float(s["step_time_s"]) for s in steps)


def _off(measured: float, predicted: float) -> float | None:
    return None if predicted <= 0 else measured / predicted - 1.0


def compare_run(plan: Plan, metrics: list[dict[str, Any]], stage_timings: list[dict[str, float]] | None = None) -> list[str]:
    """Lines comparing measured with predicted step, per-stage compute, transfer wait and idle; >20% flagged."""
    if not metrics:
        return ["no steps were measured: nothing to compare"]
    timings = stage_timings or stage_timings_from_metrics(metrics)
    step = median_step_s(metrics)
    predicted_step = plan.prediction.step_time_s
    off = _off(step, predicted_step)
    lines = [f"step time: measured {step:.4g} s, predicted {predicted_step:.4g} s"
             + (f" ({off:+.0%})" if off is not None else "")
             + (" <- more than 20% off" if off is not None and abs(off) > OFF_BY else "")]
    if off is not None and abs(off) > OFF_BY and "profile" not in plan.cost_sources:
        fallback = [f"model={plan.model.name}", f"hardware={plan.cluster.name}"]
        measure = suggest("profile", plan.config, fallback=fallback, add=["output=profile.json"])
        again = suggest("compile", plan.config, fallback=fallback, drop=("profile",), add=["profile=profile.json"])
        lines.append(f"This plan's costs come from datasheets: measure the fleet with `{measure}`, then "
                     f"compile with the measurements: `{again}`.")
    flagged = []
    for k, sp in enumerate(plan.stages):
        m = plan.micro_batches_of(k)  # its replica's share of the step
        ops = timings[k] if k < len(timings) else {}
        compute = ops.get("F", 0.0) + ops.get("B", 0.0)
        predicted_compute = m * (sp.fwd_time_s + sp.bwd_time_s)
        # Sends are asynchronous, so a transfer shows up as the receiver's wait for its tensor.
        wait = ops.get("RA", 0.0) + ops.get("RG", 0.0)
        other = ops.get("SA", 0.0) + ops.get("SG", 0.0) + ops.get("STEP", 0.0) - ops.get("clip_wait", 0.0)
        ov = sp.overhead_s
        predicted_other = m * (ov.get("SA", 0.0) + ov.get("SG", 0.0)) + ov.get("STEP", 0.0)
        predicted_idle = max(0.0, predicted_step - predicted_compute)
        measured_idle = max(0.0, step - compute)
        c_off = _off(compute, predicted_compute)
        flag = c_off is not None and abs(c_off) > OFF_BY
        if flag:
            flagged.append(k)
        lines.append(
            f"stage {k} ({sp.device}): compute {compute:.4g} s vs {predicted_compute:.4g} s predicted"
            + (f" ({c_off:+.0%})" if c_off is not None else "")
            + f"; waiting for transfers {wait:.4g} s (predicted link time {2 * m * sp.send_time_s:.4g} s)"
            + f"; idle {measured_idle:.4g} s vs {predicted_idle:.4g} s; send/optimizer overhead {other:.4g} s"
            + f" vs {predicted_other:.4g} s"
            + (" <- more than 20% off" if flag else ""))
    lines += run_verdict(plan, step, timings)
    return lines


def run_verdict(plan: Plan, step_time_s: float, timings: list[dict[str, float]]) -> list[str]:
    """The finished run's bottleneck in words, from what each stage measured."""
    if not timings or step_time_s <= 0:
        return []
    compute = [t.get("F", 0.0) + t.get("B", 0.0) for t in timings]
    waits = [t.get("RA", 0.0) + t.get("RG", 0.0) for t in timings]
    k = max(range(len(compute)), key=lambda i: compute[i])
    busy = [c / step_time_s for c in compute]
    bubble = 1.0 - sum(busy) / len(busy)
    sp = plan.stages[k] if k < len(plan.stages) else None
    name = sp.device if sp else f"stage {k}"
    out = []
    if len(compute) > 1 and bubble >= 0.2 and max(busy) < 0.8:
        out.append(f"Measured: bubble-bound, the stages idle {bubble:.0%} of the step; fix: more micro-batches "
                   f"(train.num_micro_batches above {plan.train.num_micro_batches}).")
    if busy[k] >= 0.6 or len(compute) == 1:
        out.append(f"Measured: compute-bound on {name} (stage {k} computes {busy[k]:.0%} of the step).")
    elif len(compute) > 1 and max(waits) > 0.5 * step_time_s and max(waits) > max(compute):
        j = max(range(len(waits)), key=lambda i: waits[i])
        out.append(f"Measured: transfer-bound, stage {j} waits {waits[j] / step_time_s:.0%} of the step for tensors.")
    return out or [f"Measured: no single bottleneck; the busiest stage ({name}) computes {busy[k]:.0%} of the step."]
