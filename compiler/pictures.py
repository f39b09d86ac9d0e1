"""Pictures of a plan: where the layers go (placement.png), how a step unfolds in time (schedule.png),
and the step with each stage's memory over it (simulate.png, drawn by `hetero simulate`).

Each colour has one meaning: stages take hues (red and grey left out), memory parts greys with
hatching, red warns (a device past 90% of its usable memory, the step line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on build machines and headless hosts
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

from hetero.plan import MemoryBreakdown, Plan  # noqa: E402


@dataclass(frozen=True)
class MemoryPart:
    field: str  # MemoryBreakdown field
    label: str
    colour: str
    hatch: str


# Neutral greys, dark to light, told apart by hatching too: never mistaken for a stage's hue.
MEMORY_PARTS = (
    MemoryPart("weights_gb", "weights", "#3A3A3A", ""),
    MemoryPart("lora_gb", "LoRA + optimizer", "#6E6E6E", "////"),
    MemoryPart("activations_gb", "activations", "#A3A3A3", "...."),
    MemoryPart("workspace_gb", "workspace", "#CFCFCF", "xx"),
)
# tab10 without its red (kept for warnings) and grey (kept for memory and idle time).
STAGE_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
FORWARD_COLOUR, BACKWARD_COLOUR, SEND_COLOUR = "#4C72B0", "#DD8452", "#B0B0B0"
STEP_COLOUR, REDUCE_COLOUR, IDLE_COLOUR = "#2B2B2B", "#D9D9D9", "#F2F2F2"
WARNING_COLOUR, WARNING_TINT = "#B00020", "#FDE8EA"
MEMORY_WARN_SHARE = 0.9  # a device above this share of its usable memory is drawn in red
_HOST_W, _HOST_GAP, _DEV_H, _HEADER = 4.6, 2.2, 2.5, 0.8


def stage_colour(k: int) -> str:
    """A distinct colour per stage, shared by every picture."""
    return STAGE_PALETTE[k % len(STAGE_PALETTE)]


def memory_share(memory: MemoryBreakdown) -> float:
    """Planned peak memory as a share of the usable memory (device memory less the planner's headroom)."""
    return memory.total_gb / memory.available_gb if memory.available_gb > 0 else float("inf")


def crowded_stages(plan: Plan) -> list[int]:
    """Stages whose device's planned peak exceeds 90% of its usable memory: the pictures flag them in red."""
    return [s.index for s in plan.stages if memory_share(s.memory) > MEMORY_WARN_SHARE]


def span_label(node_names: list[str]) -> str:
    """'embed + layers 0-13', 'layers 14-31 + norm + head', 'layers 5' from a stage's node names."""
    layers = [int(n.split(".", 1)[1]) for n in node_names if n.startswith("layers.")]
    before = [n for n in node_names if not n.startswith("layers.") and node_names.index(n) == 0]
    after = [n for n in node_names if not n.startswith("layers.") and n not in before]
    parts = list(before)
    if layers:
        parts.append(f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}")
    return " + ".join(parts + after)


def _title(plan: Plan) -> str:
    p = plan.prediction
    shape = f"{len(plan.replicas)} replicas, " if plan.replicas else ""
    head = (
        f"{plan.model.name}: {shape}{len(plan.stages)} stage(s), predicted {p.step_time_s:.3g} s/step, "
        f"{p.tokens_per_s:,.0f} tokens/s"
    )
    best = next((b for b in plan.baselines if b.name == "best_single_device"), None)
    if best is not None and best.feasible and best.prediction is not None:
        ratio = (
            p.tokens_per_s / best.prediction.tokens_per_s if best.prediction.tokens_per_s else float("inf")
        )
        device = best.devices[0] if best.devices else "best single device"
        head += (
            f"\n{ratio:.2f}x the best single device ({device}: {best.prediction.tokens_per_s:,.0f} tokens/s)"
        )
    elif best is not None:
        head += f"\nno single device can train it alone ({best.reason or 'does not fit'})"
    return head


def draw_placement(plan: Plan, path: str | Path) -> Path:
    """Hosts as boxes with their devices, each device's layers, memory bar and utilization; links between hosts."""
    return _save(placement_figure(plan), path)


def _save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def placement_figure(plan: Plan) -> Any:
    """The placement picture as a matplotlib Figure (draw_placement saves it)."""
    stage_of = {s.device: s for s in plan.stages}
    # Hosts left to right in pipeline order (unused hosts last), so the data flows left to right.
    first_stage = {
        h.name: min((s.index for s in plan.stages if s.host == h.name), default=len(plan.stages))
        for h in plan.cluster.hosts
    }
    hosts = sorted(plan.cluster.hosts, key=lambda h: first_stage[h.name])
    rows = max(len(h.devices) for h in hosts)
    host_h = _HEADER + rows * _DEV_H + 0.2
    width = len(hosts) * _HOST_W + (len(hosts) - 1) * _HOST_GAP
    fig_w = max(8.0, 0.95 * width + 1.0)
    names = [h.name for h in hosts]
    arcs = [
        abs(names.index(link.a) - names.index(link.b))
        for link in plan.cluster.links
        if link.a in names and link.b in names
    ]
    top = host_h + (0.5 + 0.4 * max(arcs) if arcs and max(arcs) > 1 else 0.2)
    below = 2.5 + STRIP_GAP * (len(plan.pipelines) - 1)  # room for one pipeline strip per replica
    fig, ax = plt.subplots(figsize=(fig_w, 0.95 * (top + below + 0.1)))
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(-below, top)
    ax.axis("off")

    x_of: dict[str, float] = {}
    for i, host in enumerate(hosts):
        x = i * (_HOST_W + _HOST_GAP)
        x_of[host.name] = x
        ax.add_patch(FancyBboxPatch((x, 0), _HOST_W, host_h, boxstyle="round,pad=0.05,rounding_size=0.15",
                                    fc="#F4F4F4", ec="#555555", lw=1.5))
        ax.text(x + 0.15, host_h - 0.4, f"host {host.name}", fontsize=11, weight="bold", va="center")
        ax.text(
            x + _HOST_W - 0.15,
            host_h - 0.4,
            host.address,
            fontsize=8,
            color="#666666",
            va="center",
            ha="right",
        )
        for j, device in enumerate(host.devices):
            _draw_device(
                ax, plan, device, stage_of.get(device.name), x + 0.15, host_h - _HEADER - (j + 1) * _DEV_H
            )
    _draw_links(ax, plan, x_of, host_h)
    _draw_pipeline_strip(ax, plan, width)
    ax.legend(
        *_memory_legend(),
        loc="upper right",
        ncol=3,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(1.0, 0.0),
    )
    crowded = crowded_stages(plan)
    if crowded:
        names = ", ".join(f"stage {k}" for k in crowded)
        ax.text(0, -below + 0.1, f"{names} above 90% of usable memory: little room for a longer sequence, "
                "a bigger micro-batch or an allocator's fragmentation", fontsize=8.5, color=WARNING_COLOUR)
    ax.set_title(_title(plan), fontsize=12)
    return fig


def _memory_legend() -> tuple[list[Any], list[str]]:
    handles: list[Any] = [_memory_patch(part, (0, 0), 1, 1) for part in MEMORY_PARTS]
    labels = [f"memory: {part.label}" if i == 0 else part.label for i, part in enumerate(MEMORY_PARTS)]
    handles += [Line2D([], [], color="#222222", lw=2), Line2D([], [], color=WARNING_COLOUR, lw=1.2, ls="--")]
    labels += ["usable capacity (device less headroom)", "90% of usable: above it, red"]
    return handles, labels


def _memory_patch(part: MemoryPart, xy: tuple[float, float], w: float, h: float) -> Rectangle:
    # White hatching on grey: the hatch takes the edge colour, the zero line width hides the outline.
    return Rectangle(xy, w, h, fc=part.colour, ec="white", lw=0, hatch=part.hatch)


def _draw_device(ax: Any, plan: Plan, device: Any, stage: Any, x: float, y: float) -> None:
    w, h = _HOST_W - 0.3, _DEV_H - 0.2
    colour = stage_colour(stage.index) if stage is not None else "#CCCCCC"
    crowded = stage is not None and memory_share(stage.memory) > MEMORY_WARN_SHARE
    ax.add_patch(FancyBboxPatch((x, y + 0.1), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=WARNING_TINT if crowded else "white", ec=colour,
                                lw=2.5 if stage is not None else 1.0))
    top = y + 0.1 + h
    if stage is None:
        ax.text(x + 0.12, top - 0.3, _fit(device.display_name, 44), fontsize=9, va="center")
        ax.text(
            x + 0.12,
            top - 0.75,
            "not used by this plan",
            fontsize=9,
            color="#888888",
            va="center",
            style="italic",
        )
        return
    ax.text(
        x + 0.12, top - 0.3, f"stage {stage.index}" + (f" (r{plan.replica_of(stage.index)[0]})" if plan.replicas else ""),
        fontsize=10, weight="bold", color=colour, va="center"
    )
    # The replica tag widens the stage label: the device name moves right to make room.
    ax.text(x + (1.5 if plan.replicas else 1.0), top - 0.3, _fit(device.display_name, 30 if plan.replicas else 34),
            fontsize=8.5, va="center")
    ax.text(x + 0.12, top - 0.72, span_label(stage.node_names), fontsize=9.5, va="center")
    busy = plan.prediction.stage_busy[stage.index] if stage.index < len(plan.prediction.stage_busy) else 0.0
    ax.text(
        x + 0.12,
        top - 1.1,
        f"{stage.dtype}, {stage.quantization}; busy {busy:.0%} of the step"
        + (f"; {len(stage.recompute_layers)} layers recompute (+{_duration(stage.recompute_time_s)} bwd/mb)"
           if stage.recompute_layers else ""),
        fontsize=8,
        color="#444444",
        va="center",
    )
    _draw_memory_bar(ax, stage.memory, x + 0.12, y + 0.3, w - 0.24, 0.36)


def _draw_memory_bar(ax: Any, mem: MemoryBreakdown, x: float, y: float, w: float, h: float) -> None:
    """Stacked memory parts; full width = usable memory (or the peak, when over it); capacity and 90% marked."""
    share = memory_share(mem)
    crowded = share > MEMORY_WARN_SHARE
    ax.add_patch(Rectangle((x, y), w, h, fc="white", ec=WARNING_COLOUR if crowded else "#999999",
                           lw=1.6 if crowded else 0.8))
    scale = w / max(mem.available_gb, mem.total_gb, 1e-9)
    left = x
    for part in MEMORY_PARTS:
        width = getattr(mem, part.field) * scale
        ax.add_patch(_memory_patch(part, (left, y), width, h))
        left += width
    capacity = x + mem.available_gb * scale
    ax.plot([capacity, capacity], [y - 0.08, y + h + 0.08], color="#222222", lw=2, solid_capstyle="butt")
    warn = x + MEMORY_WARN_SHARE * mem.available_gb * scale
    ax.plot([warn, warn], [y - 0.08, y + h + 0.08], color=WARNING_COLOUR, lw=1.2, ls="--")
    ax.text(x, y + h + 0.14, f"memory {mem.total_gb:.1f} / {mem.available_gb:.1f} GB usable",
            fontsize=8, va="center", color=WARNING_COLOUR if share > 1 else "#333333")
    ax.text(x + w, y + h + 0.14, f"{share:.0%}", fontsize=9 if crowded else 8, va="center", ha="right",
            color=WARNING_COLOUR if crowded else "#333333", weight="bold" if crowded else "normal")


def _duration(seconds: float) -> str:
    if seconds <= 0:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 1e-3 else "<1 ms"


def _fit(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def _draw_links(ax: Any, plan: Plan, x_of: dict[str, float], host_h: float) -> None:
    names = sorted(x_of, key=x_of.__getitem__)
    for link in plan.cluster.links:
        if link.a not in x_of or link.b not in x_of:
            continue
        a, b = sorted((link.a, link.b), key=names.index)
        gap = names.index(b) - names.index(a)
        label = f"{link.bandwidth_gbps:g} Gb/s, {link.latency_us:g} us"
        if gap == 1:  # neighbours: a straight line between the boxes, label above it
            xa, xb, y = x_of[a] + _HOST_W, x_of[b], host_h * 0.55
            ax.plot([xa, xb], [y, y], color="#333333", lw=2)
            ax.text((xa + xb) / 2, y + 0.15, label, ha="center", va="bottom", fontsize=8)
        else:  # farther apart: an arc over the top of the hosts in between
            xa, xb = x_of[a] + _HOST_W / 2, x_of[b] + _HOST_W / 2
            ax.add_patch(FancyArrowPatch((xa, host_h + 0.05), (xb, host_h + 0.05), arrowstyle="-", lw=1.5,
                                         color="#333333", connectionstyle=f"arc3,rad={-0.12 / gap}"))
            ax.text((xa + xb) / 2, host_h + 0.25 + 0.35 * gap, label, ha="center", fontsize=8,
                    bbox=dict(fc="white", ec="none", pad=1))


STRIP_GAP = 1.5  # vertical distance between the pipeline strips of two replicas


def _draw_pipeline_strip(ax: Any, plan: Plan, width: float) -> None:
    """Per pipeline replica, a bar of all graph nodes in order, coloured by stage: the pipelines at a glance."""
    for r, rep in enumerate(plan.pipelines):
        title = "pipeline order (graph nodes, coloured by stage)"
        if plan.replicas:
            title = (f"replica {r}: {rep.num_micro_batches} of {plan.train.num_micro_batches} micro-batches "
                     f"per step (graph nodes, coloured by stage)")
        _draw_strip(ax, plan, [plan.stages[k] for k in rep.stages], width, -1.6 - STRIP_GAP * r, title)


def _draw_strip(ax: Any, plan: Plan, stages: list[Any], width: float, y: float, title: str) -> None:
    nodes = len(plan.graph.nodes)
    h = 0.6
    ax.text(0, y + h + 0.3, title, fontsize=9, color="#333333")
    for stage in stages:
        x0 = width * stage.first_node / nodes
        x1 = width * (stage.last_node + 1) / nodes
        ax.add_patch(Rectangle((x0, y), x1 - x0, h, fc=stage_colour(stage.index), ec="white", lw=1.5))
        label = f"{stage.index}: {span_label(stage.node_names)}"
        if ax.figure.dpi * (x1 - x0) <= 6 * len(label):  # only when it fits; the boxes above name it anyway
            label = str(stage.index)
        ax.text((x0 + x1) / 2, y + h / 2, label, ha="center", va="center", fontsize=8, color="white")
        if stage is not stages[-1]:
            ax.text(x1, y - 0.25, f"send {_duration(stage.send_time_s)}", ha="center", va="top", fontsize=7,
                    color="#555555")


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


def schedule_blocks(timeline: Any, reduce_s: float = 0.0) -> list[Block]:
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


def draw_schedule(plan: Plan, path: str | Path, timeline: Any = None) -> Path:
    """Gantt chart of the simulated step: one row per stage, F/B boxes per micro-batch, STEP, step time marked."""
    return _save(schedule_figure(plan, timeline), path)


def schedule_figure(plan: Plan, timeline: Any = None) -> Any:
    """The schedule Gantt chart as a Figure; ``timeline`` defaults to simulate_plan(plan)."""
    if timeline is None:
        from hetero.planner.simulator import simulate_plan

        timeline = simulate_plan(plan)
    n = len(plan.stages)
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.75 * n + 1.2))
    _draw_gantt(ax, plan, timeline)
    labels = []
    for k, s in enumerate(plan.stages):
        busy = timeline.busy_fraction[k] if k < len(timeline.busy_fraction) else 0.0
        replica = f" (replica {plan.replica_of(k)[0]})" if plan.replicas else ""
        labels.append(f"stage {k}{replica}: {s.device}\n{span_label(s.node_names)}  ({busy:.0%} busy)")
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.set_xlabel("seconds into the step")
    ax.legend(*_gantt_legend(plan), loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=6, fontsize=8,
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


def _draw_gantt(ax: Any, plan: Plan, timeline: Any) -> None:
    """Rows = stages (stage 0 on top): idle background, the blocks, transfers under the rows, the step line."""
    n = len(plan.stages)
    step = timeline.step_time_s
    for k in range(n):
        ax.add_patch(Rectangle((0, k - 0.4), step, 0.8, fc=IDLE_COLOUR, ec="none"))
    min_label_w = step / 90  # about the width of two characters at this figure size
    for b in schedule_blocks(timeline, _reduce_s(plan)):
        face, hatch, text = _BLOCK_STYLE[b.kind]
        if b.kind == "STEP" and b.duration_s < min_label_w:
            # Too short to see at this scale (ms against a step of seconds): a thin marker ending where
            # the step does, named beside it with its duration.
            marker = max(b.duration_s, step / 400)
            ax.add_patch(Rectangle((b.end_s - marker, b.stage - 0.35), marker, 0.7, fc=face, ec="none"))
            ax.text(b.end_s + step / 300, b.stage, f"STEP {_duration(b.duration_s)}", ha="left",
                    va="center", fontsize=7, color=STEP_COLOUR)
            continue
        ax.add_patch(Rectangle((b.start_s, b.stage - 0.35), b.duration_s, 0.7, fc=face, ec="white", lw=0.6,
                               hatch=hatch))
        if b.duration_s > (min_label_w if b.kind in ("F", "B") else (len(b.label) + 2) * min_label_w / 2):
            ax.text(b.start_s + b.duration_s / 2, b.stage, b.label, ha="center", va="center", fontsize=7,
                    color=text)
    for e in timeline.events:
        if e.op in ("SA", "SG") and e.end_s > e.start_s:
            # Transfers: a thin bar under the sending stage's row, on the link while in flight.
            ax.add_patch(Rectangle((e.start_s, e.stage + 0.37), e.end_s - e.start_s, 0.06, fc=SEND_COLOUR,
                                   ec="none"))
    ax.axvline(step, color=WARNING_COLOUR, ls="--", lw=1.2)
    ax.text(step, -0.75, f" step {step:.3g} s", color=WARNING_COLOUR, fontsize=9, va="center")
    ax.set_ylim(n - 0.4, -1.0)
    ax.set_xlim(0, step * 1.08)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)


def _gantt_legend(plan: Plan) -> tuple[list[Any], list[str]]:
    kinds = ["F", "B"] + (["reduce"] if _reduce_s(plan) > 0 else []) + ["STEP"]
    names = {"F": "forward (micro-batch)", "B": "backward", "reduce": "sum gradients across replicas",
             "STEP": "STEP: gradient-norm sync + optimizer"}
    handles: list[Any] = [Rectangle((0, 0), 1, 1, fc=_BLOCK_STYLE[k][0], hatch=_BLOCK_STYLE[k][1], ec="white")
                          for k in kinds]
    handles += [Rectangle((0, 0), 1, 1, fc=c) for c in (SEND_COLOUR, IDLE_COLOUR)]
    return handles, [names[k] for k in kinds] + ["send", "idle"]


def memory_axis_limits(points: list[tuple[float, float]], capacity_gb: float) -> tuple[float, float]:
    """y range of a memory-over-time panel: from 0, past both the capacity and the peak, so swings keep scale."""
    peak = max((gb for _, gb in points), default=0.0)
    return 0.0, max(capacity_gb, peak, 1e-9) * 1.08


def draw_simulation(plan: Plan, timeline: Any, memory: list[list[tuple[float, float]]], path: str | Path) -> Path:
    """simulate.png: the step's Gantt on top, then per stage its memory over the step against its capacity."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(simulation_figure(plan, timeline, memory), out)


def simulation_figure(plan: Plan, timeline: Any, memory: list[list[tuple[float, float]]]) -> Any:
    """The simulate picture as a Figure; ``memory[k]`` is stage k's (time, GB) points (whatif.memory_over_time)."""
    n = len(plan.stages)
    fig, axes = plt.subplots(1 + n, 1, figsize=(11, 1.6 + 0.55 * n + 1.1 * n), sharex=True,
                             gridspec_kw={"height_ratios": [0.6 * n + 0.6] + [1.0] * n})
    gantt = axes[0]
    _draw_gantt(gantt, plan, timeline)
    gantt.set_yticks(range(n), [f"stage {k}: {s.device}" for k, s in enumerate(plan.stages)], fontsize=8)
    gantt.set_title(f"{plan.train.schedule}, {plan.train.num_micro_batches} micro-batches: "
                    f"{timeline.step_time_s:.3g} s/step, bubble {timeline.bubble_fraction:.0%}", fontsize=11)
    gantt.legend(*_gantt_legend(plan), loc="lower center", bbox_to_anchor=(0.5, 1.12), ncol=6, fontsize=7.5,
                 frameon=False)
    for k, (ax, points) in enumerate(zip(axes[1:], memory, strict=True)):
        _draw_memory_panel(ax, plan.stages[k], points, timeline.step_time_s)
    axes[-1].set_xlabel("seconds into the step")
    weights, activations = MEMORY_PARTS[0], MEMORY_PARTS[2]
    handles = [Rectangle((0, 0), 1, 1, fc=weights.colour, alpha=0.8),
               Rectangle((0, 0), 1, 1, fc=activations.colour, hatch=activations.hatch, ec="white", lw=0),
               Line2D([], [], color="#222222", lw=1.6), Line2D([], [], color=WARNING_COLOUR, lw=1.0, ls="--")]
    fig.legend(handles, ["memory held all step (weights, LoRA + optimizer, workspace)", "activations in flight",
                         "usable capacity", "90% of usable"], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # room for that legend below the x axis
    return fig


def _draw_memory_panel(ax: Any, stage: Any, points: list[tuple[float, float]], step: float) -> None:
    mem = stage.memory
    fixed = mem.total_gb - mem.activations_gb
    times, gbs = [t for t, _ in points], [gb for _, gb in points]
    weights, activations = MEMORY_PARTS[0], MEMORY_PARTS[2]
    # Weights, LoRA + optimizer and workspace stay put over the step; activations come and go.
    ax.fill_between([0, step], 0, fixed, color=weights.colour, lw=0, alpha=0.8)
    ax.fill_between(times, fixed, gbs, color=activations.colour, hatch=activations.hatch, ec="white", lw=0)
    ax.plot(times, gbs, color="#222222", lw=0.9)
    crowded = memory_share(mem) > MEMORY_WARN_SHARE
    ax.axhline(mem.available_gb, color="#222222", lw=1.6)
    ax.axhline(MEMORY_WARN_SHARE * mem.available_gb, color=WARNING_COLOUR, lw=1.0, ls="--")
    ax.set_ylim(*memory_axis_limits(points, mem.available_gb))
    ax.set_title(f"stage {stage.index} on {stage.device}: planned peak {mem.total_gb:.1f} GB of "
                 f"{mem.available_gb:.1f} GB usable "
                 f"({memory_share(mem):.0%})" + ("  - above 90%" if crowded else ""), loc="left", fontsize=8,
                 color=WARNING_COLOUR if crowded else "#222222", weight="bold" if crowded else "normal")
    ax.set_ylabel(f"stage {stage.index}\nGB", fontsize=8)
    ax.tick_params(labelsize=8)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
