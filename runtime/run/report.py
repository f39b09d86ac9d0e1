"""The run's report: measured vs predicted step time and per-stage busy time (report.json + a terminal table),
each rebalancing move with its predicted and measured gain, and steps.png (runtime/run/steps_picture.py).

A run that rebalanced ran several splits: the steps on each split are compared with the prediction for
that split (the plan's for the first, the move's event line for the next; runtime/run/run_segments.py).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from hetero.plan import Plan
from hetero.runtime.run.metrics_file import NAME, Event, Line, RunLines, StepLine, read_metrics
from hetero.runtime.run.run_compare import compare_run
from hetero.runtime.run.run_segments import (
    Segment,
    across_plans,
    move_line,
    plan_busy_s,
    run_moves,
    run_segments,
    split_text,
)
from hetero.runtime.stage.telemetry import telemetry_summary
from hetero.serde import to_dict


def _segment_entry(plan: Plan, segment: Segment) -> dict[str, Any]:
    """One split's steps against its prediction, per stage too."""
    predicted = segment.predicted_compute_s or []
    return {
        "first_step": segment.first_step, "last_step": segment.last_step, "split": segment.split,
        "after_move_at_step": segment.move.after_step if segment.move is not None else None,
        "measured_step_s": segment.median_step_s(), "predicted_step_s": segment.predicted_step_s,
        "stages": [{"stage": k, "device": sp.device, "measured_compute_s": segment.median_compute_s(k),
                    "predicted_compute_s": predicted[k] if k < len(predicted) else None}
                   for k, sp in enumerate(plan.stages)],
    }


def _stage_entries(plan: Plan, planned: Segment, step_time: float | None, build_s: dict[int, float]) -> list[dict[str, Any]]:
    """Per stage of the plan: its busy time on the plan's own split, measured and predicted."""
    stages = []
    for k, (sp, predicted) in enumerate(zip(plan.stages, plan_busy_s(plan), strict=True)):
        busy = planned.median_busy_s(k)
        stages.append({
            "stage": k, "host": sp.host, "device": sp.device,
            "layers": [*sp.node_names, *(n for c in sp.chunks for n in c.node_names)],
            "measured_busy_s": busy, "predicted_busy_s": predicted,
            "measured_busy_fraction": (busy / step_time) if busy is not None and step_time else None,
            "predicted_busy_fraction": plan.prediction.stage_busy[k] if k < len(plan.prediction.stage_busy) else None,
            "build_s": build_s.get(k),
        })
    return stages


def build_report(plan: Plan, lines: list[Line], build_s: dict[int, float], run_dir: str,
                 events: list[Event] | None = None) -> dict[str, Any]:
    """Summarize metrics.jsonl lines against the predictions: the plan's for its own split (its first step left
    out), each move's for the split it moved to (the move's own step left out). ``lines`` may hold events too."""
    run = RunLines([*lines, *(events or [])])
    steps, moves_in = run.steps, run.moves
    segments = run_segments(plan, steps, moves_in)
    planned = segments[0]
    step_time = planned.median_step_s()
    predicted = plan.prediction.step_time_s
    return {
        "run_dir": run_dir,
        "plan_hash": plan.input_hash,
        "steps": len(steps),
        "first_loss": steps[0].loss if steps else None,
        "final_loss": steps[-1].loss if steps else None,
        "measured_step_time_s": step_time,  # on the plan's own split, as the plan predicted it
        "predicted_step_time_s": predicted,
        "measured_over_predicted": (step_time / predicted) if step_time and predicted > 0 else None,
        **token_rates(plan, planned.steps, step_time),
        "stages": _stage_entries(plan, planned, step_time, build_s),
        "segments": [_segment_entry(plan, s) for s in segments],
        "moves": run_moves(segments),
        # Devices lost and left out (runtime.elastic=auto); the steps above ran on the plan after the last of them.
        "recoveries": [to_dict(e) for e in run.recoveries],
        "telemetry": telemetry_summary(steps, len(plan.stages)),
        # Measured vs predicted per stage, stages >20% off flagged, and the bottleneck in words.
        "comparison": compare_run(plan, [*steps, *moves_in]) if steps else [],
        **({"streaming": streaming_summary(plan, steps)} if any(sp.stream_layers for sp in plan.stages) else {}),
    }


def token_rates(plan: Plan, steps: list[StepLine], step_time: float | None) -> dict[str, Any]:
    """Trained (label) tokens per step and per second, measured and predicted, and the computed ones beside them
    (every row's seq_len tokens, padding included). The plan predicts trained tokens/s only where `hetero compile`
    measured the data (None otherwise)."""
    labels = [s.label_tokens for s in steps if s.label_tokens is not None]
    trained = statistics.fmean(labels) if labels else None
    computed = next((s.computed_tokens for s in steps), None)
    return {
        "label_tokens_per_step": trained,
        "computed_tokens_per_step": computed,
        "measured_tokens_per_s": (trained / step_time) if trained is not None and step_time else None,
        "predicted_tokens_per_s": plan.prediction.trained_tokens_per_s,
        "measured_computed_tokens_per_s": (computed / step_time) if computed and step_time else None,
        "predicted_computed_tokens_per_s": plan.prediction.tokens_per_s,
    }


def streaming_summary(plan: Plan, steps: list[StepLine]) -> list[dict[str, Any]]:
    """Per stage that streams weights: bytes copied per step (median over the steps) against the plan's
    streamed_bytes_per_step, and its frozen-weight peak on the device (the most over the steps) against the
    plan's frozen_resident_cap_bytes."""
    out = []
    for k, sp in enumerate(plan.stages):
        if not sp.stream_layers:
            continue
        streamed = [b for s in steps if (b := _at(s.stage_streamed_bytes, k)) is not None]
        peaks = [b for s in steps if (b := _at(s.stage_frozen_resident_peak_bytes, k)) is not None]
        peak = max(peaks) if peaks else None
        cap = sp.frozen_resident_cap_bytes
        out.append({
            "stage": k, "device": sp.device, "stream_layers": len(sp.stream_layers),
            "measured_streamed_bytes_per_step": statistics.median(streamed) if streamed else None,
            "predicted_streamed_bytes_per_step": sp.streamed_bytes_per_step,
            "measured_frozen_resident_peak_bytes": peak, "frozen_resident_cap_bytes": cap,
            "within_cap": None if peak is None or cap <= 0 else peak <= cap,
        })
    return out


def streaming_lines(summary: list[dict[str, Any]]) -> list[str]:
    """Per streaming stage: measured vs predicted bytes per step, and the frozen-weight peak vs the plan's cap."""
    lines = []
    for s in summary:
        streamed, peak = s["measured_streamed_bytes_per_step"], s["measured_frozen_resident_peak_bytes"]
        over = " -- OVER THE PLAN'S CAP" if s["within_cap"] is False else ""
        lines.append(f"weight streaming, stage {s['stage']} ({s['stream_layers']} layers): "
                     f"{_mb(streamed)} streamed per step (predicted {_mb(s['predicted_streamed_bytes_per_step'])}), "
                     f"frozen weights resident at most {_mb(peak)} (plan's cap {_mb(s['frozen_resident_cap_bytes'])})"
                     f"{over}")
    return lines


def _at(values: list[int | None] | None, k: int) -> int | None:
    return values[k] if values is not None and k < len(values) else None


def _mb(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / (1 << 20):,.1f} MB" if x >= 1 << 20 else f"{x / 1024:,.1f} KB"  # tiny test models: KB


def write_report(plan: Plan, steps: list[StepLine], build_s: dict[int, float], run_dir: Path,
                 events: list[Event] | None = None) -> dict[str, Any]:
    """build_report, then steps.png and report.json in the run directory; returns the report."""
    from hetero.runtime.run.loss_picture import draw_loss
    from hetero.runtime.run.run_files import write_report as write_report_file
    from hetero.runtime.run.steps_picture import draw_steps, label

    report = build_report(plan, steps, build_s, str(run_dir), events)
    lines: list[Line] = list(steps)
    try:  # every step of the run directory's metrics.jsonl: a resumed run's earlier ones too
        if (run_dir / NAME).is_file():
            lines = read_metrics(run_dir / NAME).lines
    except (OSError, ValueError) as exc:  # a line cut short by a full disk costs the whole run's headline only
        print(f"hetero run: could not read {run_dir / NAME}: {exc}", file=sys.stderr)
    whole = RunLines(lines).steps
    report["moves"] = [across_plans(move, whole) for move in report["moves"]]
    if len(whole) > report["steps"]:  # resumed, or re-planned after a loss: the headline counts the whole run
        report["run_steps"], report["run_first_loss"] = len(whole), whole[0].loss
    if report["steps"]:
        try:
            report["picture"] = str(draw_steps(plan, [*steps, *(events or [])], run_dir / "steps.png"))
        except OSError as exc:  # a full disk costs the picture, not the report
            print(f"hetero run: could not write {run_dir / 'steps.png'}: {exc}", file=sys.stderr)
        try:
            title = f"{label(plan.model.name)}: loss over {len(whole)} steps"
            report["loss_picture"] = str(draw_loss(lines, run_dir / "loss.png", title))
        except (OSError, ValueError) as exc:  # a full disk (or a line cut short by one) costs the picture only
            print(f"hetero run: could not write {run_dir / 'loss.png'}: {exc}", file=sys.stderr)
    write_report_file(run_dir, report)
    return report


def _fmt(x: float | None, unit: str = "s") -> str:
    return "-" if x is None else f"{x:.3f} {unit}".strip()


def print_report(report: dict[str, Any]) -> None:
    """A short table: predicted vs measured step time and per-stage busy time; then the moves, if any."""
    from rich.console import Console
    from rich.table import Table

    # The compile summary's width policy: the terminal's width, 140 columns when piped.
    console = Console(width=None if sys.stdout.isatty() else 140)
    first, steps = report["first_loss"], f"{report['steps']} steps"
    if report.get("run_steps"):  # the earlier steps came from a checkpoint or from the plan before a re-plan
        first, steps = report["run_first_loss"], f"{report['run_steps']} steps (the last {report['steps']} on this plan)"
    console.print(f"[bold]run[/bold] {report['run_dir']}: {steps}, loss {_fmt(first, '')} -> "
                  f"{_fmt(report['final_loss'], '')}", highlight=False)
    moved = " on the plan's split" if report.get("moves") else ""
    console.print(f"step time{moved}: measured {_fmt(report['measured_step_time_s'])} (median), predicted "
                  f"{_fmt(report['predicted_step_time_s'])}", highlight=False)
    console.print(tokens_line(report), highlight=False)
    table = Table("stage", "host", "device", "busy measured", "busy predicted", "busy share", "build")
    for s in report["stages"]:
        share = s["measured_busy_fraction"]
        table.add_row(str(s["stage"]), s["host"], s["device"], _fmt(s["measured_busy_s"]), _fmt(s["predicted_busy_s"]),
                      "-" if share is None else f"{100 * share:.0f}%", _fmt(s["build_s"]))
    console.print(table)
    if report.get("moves"):
        console.print(_segments_table(report["segments"]))
        console.print("[bold]moves[/bold]")
        for move in report["moves"]:
            console.print(f"  {move_line(move)}", highlight=False, markup=False)
    for event in report.get("recoveries") or []:
        console.print(recovery_line(event), highlight=False, markup=False)
    for line in (report.get("comparison", []) + telemetry_lines(report.get("telemetry") or [])
                 + streaming_lines(report.get("streaming") or [])):
        console.print(line, highlight=False, markup=False)
    if report.get("picture"):
        console.print(f"step times over the run: {report['picture']}", highlight=False)
    if report.get("loss_picture"):
        console.print(f"loss over the run: {report['loss_picture']}", highlight=False)


def recovery_line(event: dict[str, Any]) -> str:
    """``recovered after step 12: stage 1 (box.cpu1) exited: killed by SIGKILL; split 2/2/2 -> 3/3 on the devices left
    (plan-recovery-1.json); steps 10-12 trained again; 10.3 s from the loss to the next step``."""
    first, replayed = event.get("resumed_from_step"), event.get("replayed_steps")
    again = (f"steps {first}-{first + replayed - 1} trained again" if isinstance(first, int) and isinstance(replayed, int)
             and replayed > 0 else "no step trained again")
    took = f"; {event['recovery_s']:.1f} s from the loss to the next step" if isinstance(event.get("recovery_s"),
                                                                                        (int, float)) else ""
    if event.get("kind") == "rejoin":
        took = took.replace("from the loss", "from seeing it back")
        return (f"rejoined after step {event.get('after_step')}: {event.get('device')} is back; split "
                f"{split_text(event.get('old_split'))} -> {split_text(event.get('new_split'))} ({event.get('plan')}); "
                f"{again}{took}")
    return (f"recovered after step {event.get('after_step')}: stage {event.get('stage')} ({event.get('device')}) "
            f"{event.get('cause')}; split {split_text(event.get('old_split'))} -> {split_text(event.get('new_split'))} "
            f"on the devices left ({event.get('plan')}); {again}{took}")


def tokens_line(report: dict[str, Any]) -> str:
    """``trained tokens/s: measured 1,234 vs predicted 1,300; computed tokens/s, padding included: measured 4,000
    vs predicted 4,100``."""

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    predicted = report.get("predicted_tokens_per_s")
    versus = (f"vs predicted {rate(predicted)}" if predicted is not None
              else "(not predicted: the data was not measured at compile)")
    return (f"trained tokens/s: measured {rate(report.get('measured_tokens_per_s'))} {versus}; computed tokens/s, "
            f"padding included: measured {rate(report.get('measured_computed_tokens_per_s'))} vs predicted "
            f"{rate(report.get('predicted_computed_tokens_per_s'))}")


def telemetry_lines(summary: list[dict[str, Any] | None]) -> list[str]:
    """Per GPU stage that reported telemetry: its lowest clock, highest temperature, and throttled steps."""
    lines = []
    for k, t in enumerate(summary):
        if t is None:
            continue
        clock = f"lowest SM clock {t['min_sm_clock_mhz']:.0f} MHz, " if t["min_sm_clock_mhz"] is not None else ""
        heat = f"hottest {t['max_temperature_c']:.0f} C, " if t["max_temperature_c"] is not None else ""
        throttled = (f"throttled in {t['throttled_steps']} of {t['samples']} steps ({', '.join(t['throttle'])})"
                     if t["throttled_steps"] else "never throttled")
        lines.append(f"device telemetry, stage {k}: {clock}{heat}{throttled}")
    return lines


def _segments_table(segments: list[dict[str, Any]]) -> Any:
    """One row per split the run ran: its steps, step time and each stage's compute (F + B), measured / predicted."""
    from rich.table import Table

    n = len(segments[0]["stages"]) if segments else 0
    table = Table("steps", "split", "step measured / predicted", *(f"stage {k} compute measured / predicted" for k in range(n)),
                  title="each split against its own prediction")
    for seg in segments:
        steps = "-" if seg["first_step"] is None else f"{seg['first_step']}-{seg['last_step']}"
        table.add_row(steps, split_text(seg["split"]), f"{_fmt(seg['measured_step_s'])} / {_fmt(seg['predicted_step_s'])}",
                      *(f"{_fmt(s['measured_compute_s'])} / {_fmt(s['predicted_compute_s'])}" for s in seg["stages"]))
    return table
