"""The run report's comparison: measured vs predicted per-stage compute, transfer wait and idle time.

Call at the end of `hetero run` with the plan, the metrics.jsonl lines and the per-stage op timings;
it returns lines for the report and flags any stage more than 20% off its prediction. Torch-free
(the runtime never imports pulp): predictions are read from the plan's own numbers, and after a
rebalancing move from the move's event line (runtime/run/run_segments.py). The one home for reading a
finished run: ``finished_run`` reads a run directory's metrics.jsonl for a plan (refusing a run of
another plan), and ``versus_plan`` is what `hetero simulate PLAN --run-dir DIR` prints.

metrics.jsonl's lines are read as their records (runtime/run/metrics_file.py): steps, evaluations and events.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from hetero.errors import ConfigError
from hetero.hints import suggest
from hetero.plan import Plan
from hetero.runtime.run.metrics_file import NAME, Line, RebalanceEvent, RunLines, StepLine, read_metrics
from hetero.runtime.run.run_segments import Segment, compute_s, run_segments, split_text

OFF_BY = 0.20  # a stage more than 20% off its prediction is flagged


def stage_timings_from_metrics(steps: list[StepLine]) -> list[dict[str, float]]:
    """Median per-op seconds per stage over the steps (the first step is left out: it warms up)."""
    steps = steps[1:] if len(steps) > 1 else steps
    if not steps or not steps[0].stage_ops:
        return []
    out = []
    for k in range(len(steps[0].stage_ops)):
        ops = {op for s in steps for op in s.stage_ops[k]}
        out.append({op: statistics.median(float(s.stage_ops[k].get(op, 0.0)) for s in steps) for op in sorted(ops)})
    return out


def median_step_s(steps: list[StepLine]) -> float:
    """The run's measured step time: the median over its steps, the first (warm-up) left out when possible."""
    steps = steps[1:] if len(steps) > 1 else steps
    return statistics.median(s.step_time_s for s in steps)


def _off(measured: float, predicted: float) -> float | None:
    return None if predicted <= 0 else measured / predicted - 1.0


def compare_run(plan: Plan, metrics: list[Line], stage_timings: list[dict[str, float]] | None = None) -> list[str]:
    """Lines comparing measured with predicted step, per-stage compute, transfer wait and idle; >20% flagged.

    After a rebalancing move, the steps on each split are compared with that split's prediction."""
    steps, moves = RunLines(metrics).steps, RunLines(metrics).moves
    if not steps:
        return ["no steps were measured: nothing to compare"]
    segments = run_segments(plan, steps, moves)
    planned = segments[0].steps
    lines = (plan_lines(plan, planned, stage_timings if len(segments) == 1 else None, moved=len(segments) > 1)
             if planned else ["no step ran on the plan's own split"])
    for segment in segments[1:]:
        lines += segment_lines(plan, segment)
    # The verdict is about how the run ended: the last split that ran.
    last = next(s for s in reversed(segments) if s.steps)
    timings = stage_timings if stage_timings and len(segments) == 1 else stage_timings_from_metrics(last.steps)
    return lines + run_verdict(plan, median_step_s(last.steps), timings)


def plan_lines(plan: Plan, metrics: list[StepLine], stage_timings: list[dict[str, float]] | None,
               moved: bool = False) -> list[str]:
    """The steps on the plan's own split against the plan: step time, then per stage compute, waits, idle.
    ``moved``: the run rebalanced, so a device changed speed and re-profiling is not the fix."""
    timings = stage_timings or stage_timings_from_metrics(metrics)
    step = median_step_s(metrics)
    predicted_step = plan.prediction.step_time_s
    off = _off(step, predicted_step)
    lines = [f"step time: measured {step:.4g} s, predicted {predicted_step:.4g} s"
             + (f" ({off:+.0%})" if off is not None else "")
             + (" <- more than 20% off" if off is not None and abs(off) > OFF_BY else "")]
    if off is not None and abs(off) > OFF_BY and "profile" not in plan.cost_sources and not moved:
        fallback = [f"model={plan.model.name}", f"hardware={plan.cluster.name}"]
        measure = suggest("profile", plan.config, fallback=fallback, add=["output=profile.json"])
        again = suggest("compile", plan.config, fallback=fallback, drop=("profile",), add=["profile=profile.json"])
        lines.append(f"This plan's costs come from datasheets: measure the fleet with `{measure}`, then "
                     f"compile with the measurements: `{again}`.")
    for k, sp in enumerate(plan.stages):
        m = plan.micro_batches_of(k)  # its replica's share of the step
        ops = timings[k] if k < len(timings) else {}
        compute = compute_s(ops)
        predicted_compute = m * sp.compute_s()
        # Sends are asynchronous, so a transfer shows up as the receiver's wait for its tensor.
        wait = ops.get("RA", 0.0) + ops.get("RG", 0.0)
        other = ops.get("SA", 0.0) + ops.get("SG", 0.0) + ops.get("STEP", 0.0) - ops.get("clip_wait", 0.0)
        ov = sp.overhead_s
        predicted_other = m * (ov.get("SA", 0.0) + ov.get("SG", 0.0)) + ov.get("STEP", 0.0)
        predicted_idle = max(0.0, predicted_step - predicted_compute)
        measured_idle = max(0.0, step - compute)
        c_off = _off(compute, predicted_compute)
        flag = c_off is not None and abs(c_off) > OFF_BY
        lines.append(
            f"stage {k} ({sp.device}): compute {compute:.4g} s vs {predicted_compute:.4g} s predicted"
            + (f" ({c_off:+.0%})" if c_off is not None else "")
            + f"; waiting for transfers {wait:.4g} s (predicted link time {2 * m * sp.send_time_s:.4g} s)"
            + f"; idle {measured_idle:.4g} s vs {predicted_idle:.4g} s; send/optimizer overhead {other:.4g} s"
            + f" vs {predicted_other:.4g} s"
            + (" <- more than 20% off" if flag else ""))
    return lines


def _versus(measured: float | None, predicted: float | None) -> str:
    """'1.2 s vs 1.0 s predicted (+20%) <- more than 20% off', or what is missing."""
    if measured is None:
        return "not measured"
    if predicted is None:
        return f"{measured:.4g} s (no prediction)"
    off = _off(measured, predicted)
    return (f"{measured:.4g} s vs {predicted:.4g} s predicted" + (f" ({off:+.0%})" if off is not None else "")
            + (" <- more than 20% off" if off is not None and abs(off) > OFF_BY else ""))


def segment_lines(plan: Plan, segment: Segment) -> list[str]:
    """The steps after a move against the move's prediction for its split: step time, then compute per stage."""
    after = segment.move.after_step if segment.move is not None else None
    if not segment.steps:
        return [f"after the move at step {after}: no step ran on split {split_text(segment.split)}"]
    lines = [f"after the move at step {after}, split {split_text(segment.split)} (steps "
             f"{segment.first_step}-{segment.last_step}): step time {_versus(segment.median_step_s(), segment.predicted_step_s)}"]
    predicted = segment.predicted_compute_s or []
    for k, sp in enumerate(plan.stages):
        compute = segment.median_compute_s(k)
        lines.append(f"  stage {k} ({sp.device}): compute {_versus(compute, predicted[k] if k < len(predicted) else None)}")
    return lines


def run_verdict(plan: Plan, step_time_s: float, timings: list[dict[str, float]]) -> list[str]:
    """The finished run's bottleneck in words, from what each stage measured."""
    if not timings or step_time_s <= 0:
        return []
    compute = [compute_s(t) for t in timings]
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


def versus_plan(plan: Plan, run_dir: Path) -> list[str]:
    """Lines comparing a finished run with its plan: measured, predicted, and the replay of the run's own times;
    after a rebalancing move, the steps on each split against that split's prediction, and the move itself."""
    from hetero.runtime.run.run_segments import move_line, run_moves

    lines = finished_run(plan, run_dir)
    steps = lines.steps
    segments = run_segments(plan, steps, lines.moves)
    if not steps:
        raise ConfigError(f"{run_dir / NAME} has no training steps: pass the --run-dir of a finished `hetero run`")
    out = _segment_versus_plan(plan, run_dir, segments[0].steps, plan.prediction.step_time_s, None)
    for segment, move in zip(segments[1:], run_moves(segments), strict=True):
        out.append(move_line(move))
        if segment.steps:
            out += _segment_versus_plan(plan, run_dir, segment.steps, segment.predicted_step_s, segment.move)
    return out


def _segment_versus_plan(plan: Plan, run_dir: Path, steps: list[StepLine], predicted: float | None,
                         move: RebalanceEvent | None) -> list[str]:
    """The steps on one split: measured, predicted (the plan's, or the move's for its split), replayed."""
    from hetero.planner.schedule.simulator import replay_run  # (the planner's simulator: no solver, no torch)

    if not steps:
        return ["no step ran on the plan's own split"]
    if move is not None and move.plan and (run_dir / move.plan).is_file():
        plan = Plan.load(run_dir / move.plan)  # a re-plan move: its steps ran that plan's programs
    timings = stage_timings_from_metrics(steps)
    if not timings or len(timings) != len(plan.stages):
        raise ConfigError(f"{run_dir / NAME} has no per-stage timings for this {len(plan.stages)}-stage plan")
    measured = median_step_s(steps)
    replayed = replay_run(plan, timings).step_time_s
    where = "" if move is None else f"  on split {split_text(move.new_split)}: "
    versus = (f"predicted {predicted:.4g} s (measured/predicted {measured / predicted:.2f})" if predicted
              else "no prediction for this split")
    lines = [f"{where}measured {measured:.4g} s/step (median over {len(steps)} steps, the first left out); {versus}; "
             f"replayed with the run's own per-action times {replayed:.4g} s (measured/replayed {measured / replayed:.2f})"]
    if abs(measured / replayed - 1) <= 0.10 and predicted and abs(measured / predicted - 1) > 0.10:
        lines.append(f"{where}The schedule model holds (the replay is within 10%): the per-stage compute estimates were "
                     "off. Re-profile (`hetero profile`) on a quiet machine, or look for a device slower than profiled.")
    elif abs(measured / replayed - 1) > 0.10:
        lines.append(f"{where}Even the run's own per-action times do not add up to its step: it lost time the simulator "
                     "does not model (transfer latency, stages sharing cores, other load on the hosts).")
    elif predicted:
        lines.append(f"{where}The prediction held (within 10%).")
    return lines


def finished_run(plan: Plan, run_dir: Path) -> RunLines:
    """The lines of a finished run of ``plan`` (metrics.jsonl: steps, evaluations, moves); one line if it is not one."""
    metrics = read_metrics(run_dir / NAME, strict=True)
    if (run_dir / "plan.json").is_file():
        ran = Plan.load(run_dir / "plan.json")
        shape = [(s.device, s.spans(), s.program) for s in ran.stages]
        if shape != [(s.device, s.spans(), s.program) for s in plan.stages]:
            raise ConfigError(f"{run_dir} ran another plan (other stages, spans or schedule) than this one: "
                              "compare a run with the plan it ran")
    return metrics
