"""steps.png (drawn after `hetero run`, and by `hetero simulate --run`): the step time over the run, each stage's
busy time, the predicted step time of each split as a dashed line, and each rebalancing move as a
vertical line labelled old -> new split; below, where the devices report it, their SM clocks and temperature.

What is drawn is decided by ``steps_picture_data`` (tested without looking at pixels); the colours are
hetero/picture_style.py's, the compiler's pictures' own (the runtime does not import the compiler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero.picture_style import STEP_COLOUR, duration, save_figure, stage_colour
from hetero.plan import Plan
from hetero.runtime.run.metrics_file import Line, RunLines, StepLine
from hetero.runtime.run.run_segments import run_moves, run_segments, split_text

MOVE_COLOUR = "#555555"
LABEL_CHARS = 60  # a name in a picture's title is cut to this (a hand-edited plan's 2 MB name cannot be drawn)


def label(name: str) -> str:
    """``name`` as a picture shows it: at most LABEL_CHARS characters."""
    return name if len(name) <= LABEL_CHARS else name[:LABEL_CHARS - 1] + "…"


@dataclass
class StepsPicture:
    """What steps.png shows, in data: every series is (step numbers, values)."""

    title: str
    steps: list[int]
    step_time_s: list[float]
    stage_busy_s: list[tuple[str, list[float]]]  # (legend label, per step)
    predicted: list[tuple[float, float, float]]  # (from x, to x, predicted step seconds) per split
    moves: list[tuple[float, str]]  # (x between the steps, label)
    top_s: float  # the y axis ends here: the steady steps set the scale, not a warm-up or a move's own step
    clipped: list[tuple[int, float]] = field(default_factory=list)  # (step, seconds) of the steps above top_s
    clocks: list[tuple[int, str, list[int], list[float]]] = field(default_factory=list)  # (stage, label, steps, MHz)
    temperatures: list[tuple[int, str, list[int], list[float]]] = field(default_factory=list)  # (stage, label, steps, C)


def _telemetry_series(plan: Plan, steps: list[StepLine], key: str) -> list[tuple[int, str, list[int], list[float]]]:
    """Per stage that reported ``key`` (stage_telemetry), its readings by step; none for a CPU stage."""
    out = []
    for k, sp in enumerate(plan.stages):
        xs, ys = [], []
        for s in steps:
            t = s.stage_telemetry
            value = t[k].get(key) if t is not None and k < len(t) and t[k] is not None else None  # type: ignore[union-attr]
            if isinstance(value, (int, float)):
                xs.append(s.step)
                ys.append(float(value))
        if xs:
            out.append((k, f"stage {k} ({sp.device})", xs, ys))
    return out


def _move_label(move: dict[str, Any]) -> str:
    who = f"{move['device']} {move['slowdown']:.2g}x slower" if move.get("device") and move.get("slowdown") else ""
    gains = []
    if move.get("predicted_gain") is not None:
        gains.append(f"predicted {move['predicted_gain']:.2f}x")
    if move.get("measured_gain") is not None:
        gains.append(f"measured {move['measured_gain']:.2f}x")
    lines = [f"{split_text(move.get('old_split'))} -> {split_text(move.get('new_split'))}", who, ", ".join(gains)]
    return "\n".join(line for line in lines if line)


def steps_picture_data(plan: Plan, lines: list[Line]) -> StepsPicture:
    """What steps.png draws for a run of ``plan``: its metrics.jsonl lines (its moves among them)."""
    run = RunLines(lines)
    steps = run.steps
    segments = run_segments(plan, steps, run.moves)
    predicted = [(seg.steps[0].step - 0.5, seg.steps[-1].step + 0.5, seg.predicted_step_s)
                 for seg in segments if seg.steps and seg.predicted_step_s is not None]
    moves = [(m["after_step"] + 0.5, _move_label(m)) for m in run_moves(segments) if isinstance(m["after_step"], int)]
    busy = [(f"stage {k} busy ({sp.device})", [s.stage_busy[k] for s in steps])
            for k, sp in enumerate(plan.stages) if all(k < len(s.stage_busy) for s in steps)]
    title = (f"{label(plan.model.name)} on {label(plan.cluster.name)}: {len(steps)} steps"
             + (f", {len(moves)} rebalancing move{'s' if len(moves) != 1 else ''}" if moves else ""))
    steady = [s.step_time_s for seg in segments for s in seg.measured]
    # Headroom above the steady steps for the moves' labels.
    top = 1.4 * max(steady + [y for _, _, y in predicted] + [v for _, vs in busy for v in vs], default=1.0)
    clipped = [(s.step, s.step_time_s) for s in steps if s.step_time_s > top]
    return StepsPicture(title, [s.step for s in steps], [s.step_time_s for s in steps], busy,
                        [(a, b, float(y)) for a, b, y in predicted], moves, top, clipped,
                        _telemetry_series(plan, steps, "sm_clock_mhz"), _telemetry_series(plan, steps, "temperature_c"))


def draw_steps(plan: Plan, lines: list[Line], path: str | Path) -> Path:
    """steps.png at ``path`` for a run of ``plan`` (metrics.jsonl lines, its moves among them); returns the path."""
    import matplotlib.pyplot as plt  # after hetero.picture_style chose the file-only backend

    data = steps_picture_data(plan, lines)
    panels = 2 if data.clocks or data.temperatures else 1
    fig, axes = plt.subplots(panels, 1, figsize=(11, 4.2 + 2.4 * (panels - 1)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [2.4, 1.4][:panels]})
    ax = axes[0][0]
    ax.plot(data.steps, data.step_time_s, color=STEP_COLOUR, lw=2.0, marker="o", ms=3, label="step time")
    for k, (label, values) in enumerate(data.stage_busy_s):
        ax.plot(data.steps, values, color=stage_colour(k), lw=1.2, label=label)
    for i, (x0, x1, y) in enumerate(data.predicted):
        ax.hlines(y, x0, x1, colors=STEP_COLOUR, linestyles="--", lw=1.2, label="predicted step time" if i == 0 else None)
    ax.set_ylim(0, data.top_s)
    for step, seconds in data.clipped:  # a warm-up or a move's own step, off the scale: marked, its time written
        ax.plot([step], [data.top_s], marker="^", color=STEP_COLOUR, ms=6, clip_on=False)
        ax.annotate(duration(seconds), (step, data.top_s), xytext=(5, -2), textcoords="offset points", fontsize=7,
                    va="top", color=STEP_COLOUR)
    for x, label in data.moves:
        for row in axes:
            row[0].axvline(x, color=MOVE_COLOUR, lw=1.0)
        ax.text(x + 0.15, data.top_s * 0.9, label, fontsize=7.5, va="top", ha="left", color=MOVE_COLOUR,
                bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1.5})
    ax.set_ylabel("seconds per step")
    ax.set_title(data.title, fontsize=11)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=min(4, 2 + len(data.stage_busy_s)), fontsize=8,
              frameon=False)
    if panels == 2:
        _draw_telemetry(axes[1][0], data)
    axes[-1][0].set_xlabel("step")
    for row in axes:
        for spine in ("top", "right"):
            row[0].spines[spine].set_visible(False)
        row[0].tick_params(labelsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out)


def _draw_telemetry(ax: Any, data: StepsPicture) -> None:
    """Per GPU stage its SM clock (solid, left axis) and temperature (dotted, right axis)."""
    for k, label, xs, ys in data.clocks:
        ax.plot(xs, ys, color=stage_colour(k), lw=1.2, label=f"{label} SM clock")
    ax.set_ylabel("SM clock (MHz)", fontsize=8)
    handles, labels = ax.get_legend_handles_labels()
    if data.temperatures:
        twin = ax.twinx()
        for k, label, xs, ys in data.temperatures:
            twin.plot(xs, ys, color=stage_colour(k), lw=1.0, ls=":", label=f"{label} temperature")
        twin.set_ylabel("temperature (C)", fontsize=8)
        twin.tick_params(labelsize=8)
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="upper left", fontsize=7, frameon=False)
