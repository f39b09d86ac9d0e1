"""schedule.png: the Gantt chart of a simulated step, one row per stage: F/B boxes per micro-batch, the
replicas' gradient sum, each stage's STEP, the transfers under the rows and the step time marked.

The timeline is the caller's (hetero.planner.schedule.simulator.simulate_plan): nothing here simulates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
from matplotlib.collections import PolyCollection
from matplotlib.patches import Rectangle

from hetero.compiler.picture_style import (
    BACKWARD_COLOUR,
    FORWARD_COLOUR,
    IDLE_COLOUR,
    REDUCE_COLOUR,
    SEND_COLOUR,
    STEP_COLOUR,
    WARNING_COLOUR,
    duration,
    save_figure,
    span_label,
)
from hetero.plan import Plan

if TYPE_CHECKING:
    from hetero.planner.schedule.simulator import Timeline


@dataclass(frozen=True)
class Block:
    """One box of the Gantt chart: a stage's compute (F, B), the replicas' gradient sum, or its STEP."""

    stage: int
    kind: str  # F | B | reduce | STEP
    mb: int
    start_s: float
    duration_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @property
    def label(self) -> str:
        return f"{self.kind}{self.mb}" if self.kind in ("F", "B") else self.kind


def schedule_blocks(timeline: Timeline, reduce_s: float = 0.0) -> list[Block]:
    """The boxes of a simulated step: F/B per micro-batch, then per stage the gradient sum across
    replicas (``reduce_s``, when there are several) and the STEP (gradient-norm round trip + optimizer).

    A STEP event starts when its stage reaches the barrier and ends after its update; the stage only
    works from the barrier on (the latest stage to arrive, plus the reduction), so the block starts
    there and the wait before it is idle time. The last block ends at the step time.
    """
    blocks = [Block(e.stage, e.op, e.mb, e.start_s, e.end_s - e.start_s)
              for e in timeline.events if e.op in ("F", "B")]
    steps = [e for e in timeline.events if e.op == "STEP"]
    if not steps:
        return blocks
    barrier = max(e.start_s for e in steps) + reduce_s
    for e in sorted(steps, key=lambda e: e.stage):
        if reduce_s > 0:
            blocks.append(Block(e.stage, "reduce", -1, barrier - reduce_s, reduce_s))
        start = min(max(e.start_s, barrier), e.end_s)
        blocks.append(Block(e.stage, "STEP", -1, start, e.end_s - start))
    return blocks


def _reduce_s(plan: Plan) -> float:
    # As simulate_plan: one pipeline has no gradients to sum across replicas.
    return plan.prediction.reduce_s if len(plan.pipelines) > 1 else 0.0


def draw_schedule(plan: Plan, timeline: Timeline, path: str | Path) -> Path:
    """Gantt chart of the simulated step: one row per stage, F/B boxes per micro-batch, STEP, step time marked."""
    return save_figure(schedule_figure(plan, timeline), path)


def schedule_figure(plan: Plan, timeline: Timeline) -> Any:
    """The schedule Gantt chart of ``timeline`` (simulate_plan(plan)) as a Figure."""
    n = len(plan.stages)
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.75 * n + 1.2))
    draw_gantt(ax, plan, timeline)
    labels = []
    for k, s in enumerate(plan.stages):
        busy = timeline.busy_fraction[k] if k < len(timeline.busy_fraction) else 0.0
        replica = f" (replica {plan.replica_of(k)[0]})" if plan.replicas else ""
        held = " + ".join(span_label(names) for names in [s.node_names, *(c.node_names for c in s.chunks)])
        labels.append(f"stage {k}{replica}: {s.device}\n{held}  ({busy:.0%} busy)")
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.set_xlabel("seconds into the step")
    ax.legend(*gantt_legend(plan), loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=6, fontsize=8,
              frameon=False)
    replicas = f"{len(plan.replicas)} replicas, " if plan.replicas else ""
    ax.set_title(
        f"{plan.schedule} schedule, {replicas}{plan.train.num_micro_batches} micro-batches of "
        f"{plan.train.micro_batch_size} x {plan.model.seq_len} tokens: step {timeline.step_time_s:.3g} s, "
        f"bubble {timeline.bubble_fraction:.0%}",
        fontsize=11,
    )
    return fig


_BLOCK_STYLE = {  # kind: (face colour, hatch, text colour)
    "F": (FORWARD_COLOUR, "", "white"),
    "B": (BACKWARD_COLOUR, "", "white"),
    "reduce": (REDUCE_COLOUR, "////", "#222222"),
    "STEP": (STEP_COLOUR, "", "white"),
}
_X_MARGIN = 1.08  # the x axis runs this far past the step: room for the step's label and short STEPs' names
_LABEL_PT = 7  # font size of the names in the boxes


def draw_gantt(ax: Any, plan: Plan, timeline: Timeline) -> None:
    """Rows = stages (stage 0 on top): idle background, the blocks, transfers under the rows, the step line.

    Boxes of one kind go into one collection: a step of many stages and micro-batches has a thousand of
    them, and one patch per box took seconds to draw. A box is named only where its name fits inside it.
    """
    n = len(plan.stages)
    step = timeline.step_time_s
    _add_boxes(ax, [(0.0, k - 0.4, step, 0.8) for k in range(n)], facecolors=IDLE_COLOUR, edgecolors="none")
    _draw_blocks(ax, schedule_blocks(timeline, _reduce_s(plan)), step)
    # Transfers: a thin bar under the sending stage's row, on the link while in flight.
    _add_boxes(ax, [(e.start_s, e.stage + 0.37, e.end_s - e.start_s, 0.06) for e in timeline.events
                   if e.op in ("SA", "SG") and e.end_s > e.start_s], facecolors=SEND_COLOUR, edgecolors="none")
    ax.axvline(step, color=WARNING_COLOUR, ls="--", lw=1.2)
    ax.text(step, -0.75, f" step {step:.3g} s", color=WARNING_COLOUR, fontsize=9, va="center")
    ax.set_ylim(n - 0.4, -1.0)
    ax.set_xlim(0, step * _X_MARGIN)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)


def _draw_blocks(ax: Any, blocks: list[Block], step: float) -> None:
    """The blocks, one collection per kind, each named inside when its name fits; a STEP too short for
    its name (ms against a step of seconds) is at least a thin marker ending where the step does, named
    beside it with its duration."""
    points_per_s = ax.get_position().width * ax.figure.get_figwidth() * 72 / (step * _X_MARGIN)
    boxes: dict[str, list[tuple[float, float, float, float]]] = {kind: [] for kind in _BLOCK_STYLE}
    markers: list[tuple[float, float, float, float]] = []
    for b in blocks:
        named = _label_fits(b.label, b.duration_s * points_per_s)
        if b.kind == "STEP" and not named:
            width = max(b.duration_s, step / 400)
            markers.append((b.end_s - width, b.stage - 0.35, width, 0.7))
            ax.text(b.end_s + step / 300, b.stage, f"STEP {duration(b.duration_s)}", ha="left",
                    va="center", fontsize=_LABEL_PT, color=STEP_COLOUR)
            continue
        boxes[b.kind].append((b.start_s, b.stage - 0.35, b.duration_s, 0.7))
        if named:
            ax.text(b.start_s + b.duration_s / 2, b.stage, b.label, ha="center", va="center",
                    fontsize=_LABEL_PT, color=_BLOCK_STYLE[b.kind][2])
    for kind, rects in boxes.items():
        face, hatch, _ = _BLOCK_STYLE[kind]
        _add_boxes(ax, rects, facecolors=face, edgecolors="white", linewidths=0.6, hatch=hatch or None)
    _add_boxes(ax, markers, facecolors=STEP_COLOUR, edgecolors="none")  # no white edge to hide a thin one


def _label_fits(label: str, width_pt: float) -> bool:
    """Whether ``label`` at the boxes' font size fits inside a box ``width_pt`` points wide (about 0.62 em
    a character in DejaVu Sans, a point of room each side)."""
    return len(label) * 0.62 * _LABEL_PT + 2 <= width_pt


def _add_boxes(ax: Any, rects: list[tuple[float, float, float, float]], **style: Any) -> None:
    """``rects`` (x, y, width, height in data units) as one PolyCollection: one artist, one draw call."""
    if rects:
        verts = [((x, y), (x, y + h), (x + w, y + h), (x + w, y)) for x, y, w, h in rects]
        ax.add_collection(PolyCollection(verts, closed=True, **style), autolim=False)


def gantt_legend(plan: Plan) -> tuple[list[Any], list[str]]:
    """Legend handles and labels of the Gantt chart's boxes (the replicas' sum only when there is one)."""
    kinds = ["F", "B"] + (["reduce"] if _reduce_s(plan) > 0 else []) + ["STEP"]
    names = {"F": "forward (micro-batch)", "B": "backward", "reduce": "sum gradients across replicas",
             "STEP": "STEP: gradient-norm sync + optimizer"}
    handles: list[Any] = [Rectangle((0, 0), 1, 1, fc=_BLOCK_STYLE[k][0], hatch=_BLOCK_STYLE[k][1], ec="white")
                          for k in kinds]
    handles += [Rectangle((0, 0), 1, 1, fc=c) for c in (SEND_COLOUR, IDLE_COLOUR)]
    return handles, [names[k] for k in kinds] + ["send", "idle"]
