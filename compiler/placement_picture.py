"""placement.png: hosts as boxes with their devices, each device's layers, memory bar and utilization,
the links between hosts, and one strip per pipeline replica of the graph's nodes coloured by stage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from hetero.compiler.picture_style import (
    MEMORY_PARTS,
    MEMORY_WARN_SHARE,
    WARNING_COLOUR,
    WARNING_TINT,
    MemoryPart,
    crowded_stages,
    duration,
    fit_text,
    memory_share,
    save_figure,
    span_label,
    stage_colour,
)
from hetero.plan import MemoryBreakdown, Plan, Prediction

_HOST_W, _HOST_GAP, _DEV_H, _HEADER = 4.6, 2.2, 2.5, 0.8
STRIP_GAP = 1.5  # vertical distance between the pipeline strips of two replicas


def draw_placement(plan: Plan, path: str | Path) -> Path:
    """Hosts as boxes with their devices, each device's layers, memory bar and utilization; links between hosts."""
    return save_figure(placement_figure(plan), path)


@dataclass(frozen=True)
class _Layout:
    """Where the placement picture puts things (data coordinates): hosts left to right, their height,
    the width of the row of hosts, and the room above it (arcs) and below it (pipeline strips)."""

    hosts: list[Any]
    host_h: float
    width: float
    top: float
    below: float


def _layout(plan: Plan) -> _Layout:
    """Hosts left to right in pipeline order (unused hosts last), so the data flows left to right."""
    first_stage = {
        h.name: min((s.index for s in plan.stages if s.host == h.name), default=len(plan.stages))
        for h in plan.cluster.hosts
    }
    hosts = sorted(plan.cluster.hosts, key=lambda h: first_stage[h.name])
    rows = max(len(h.devices) for h in hosts)
    host_h = _HEADER + rows * _DEV_H + 0.2
    width = len(hosts) * _HOST_W + (len(hosts) - 1) * _HOST_GAP
    names = [h.name for h in hosts]
    arcs = [
        abs(names.index(link.a) - names.index(link.b))
        for link in plan.cluster.links
        if link.a in names and link.b in names
    ]
    top = host_h + (0.5 + 0.4 * max(arcs) if arcs and max(arcs) > 1 else 0.2)
    below = 2.5 + STRIP_GAP * (len(plan.pipelines) - 1)  # room for one pipeline strip per replica
    return _Layout(hosts, host_h, width, top, below)


def placement_figure(plan: Plan) -> Any:
    """The placement picture as a matplotlib Figure (draw_placement saves it)."""
    layout = _layout(plan)
    fig_w = max(8.0, 0.95 * layout.width + 1.0)
    fig, ax = plt.subplots(figsize=(fig_w, 0.95 * (layout.top + layout.below + 0.1)))
    ax.set_xlim(-0.3, layout.width + 0.3)
    ax.set_ylim(-layout.below, layout.top)
    ax.axis("off")
    stage_of = {s.device: s for s in plan.stages}
    x_of: dict[str, float] = {}
    for i, host in enumerate(layout.hosts):
        x_of[host.name] = i * (_HOST_W + _HOST_GAP)
        _draw_host(ax, plan, host, stage_of, x_of[host.name], layout.host_h)
    _draw_links(ax, plan, x_of, layout.host_h)
    _draw_pipeline_strip(ax, plan, layout.width)
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
        ax.text(0, -layout.below + 0.1, f"{names} above 90% of usable memory: little room for a longer sequence, "
                "a bigger micro-batch or an allocator's fragmentation", fontsize=8.5, color=WARNING_COLOUR)
    ax.set_title(_title(plan), fontsize=12)
    return fig


def _rate(p: Prediction) -> str:
    """Trained tokens/s where the data was measured at compile, else computed tokens/s, said so."""
    if p.trained_tokens_per_s is not None:
        return f"{p.trained_tokens_per_s:,.0f} trained tokens/s"
    return f"{p.tokens_per_s:,.0f} computed tokens/s"


def _title(plan: Plan) -> str:
    """The plan's throughput, and how it compares with the best single device."""
    p = plan.prediction
    shape = f"{len(plan.replicas)} replicas, " if plan.replicas else ""
    head = (
        f"{plan.model.name}: {shape}{len(plan.stages)} stage(s), predicted {p.step_time_s:.3g} s/step, "
        f"{_rate(p)}"
    )
    best = next((b for b in plan.baselines if b.name == "best_single_device"), None)
    if best is not None and best.feasible and best.prediction is not None:
        ratio = (
            p.tokens_per_s / best.prediction.tokens_per_s if best.prediction.tokens_per_s else float("inf")
        )
        device = best.devices[0] if best.devices else "best single device"
        head += (
            f"\n{ratio:.2f}x the best single device ({device}: {_rate(best.prediction)})"
        )
    elif best is not None:
        head += f"\nno single device can train it alone ({best.reason or 'does not fit'})"
    return head


def _draw_host(ax: Any, plan: Plan, host: Any, stage_of: dict[str, Any], x: float, host_h: float) -> None:
    """One host's box with its name and address, its devices stacked inside."""
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
        _draw_device(ax, plan, device, stage_of.get(device.name), x + 0.15, host_h - _HEADER - (j + 1) * _DEV_H)


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
        ax.text(x + 0.12, top - 0.3, fit_text(device.display_name, 44), fontsize=9, va="center")
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
    ax.text(x + (1.5 if plan.replicas else 1.0), top - 0.3,
            fit_text(device.display_name, 30 if plan.replicas else 34), fontsize=8.5, va="center")
    held = " + ".join(span_label(names) for names in [stage.node_names, *(c.node_names for c in stage.chunks)])
    ax.text(x + 0.12, top - 0.72, held, fontsize=9.5, va="center")
    busy = plan.prediction.stage_busy[stage.index] if stage.index < len(plan.prediction.stage_busy) else 0.0
    ax.text(
        x + 0.12,
        top - 1.1,
        f"{stage.dtype}, {stage.quantization}; busy {busy:.0%} of the step"
        + (f"; {len(stage.recompute_layers)} layers recompute (+{duration(stage.recompute_time_s)} bwd/mb)"
           if stage.recompute_layers else ""),
        fontsize=8,
        color="#444444",
        va="center",
    )
    if stage.stream_layers:  # weights streamed from host RAM (planner.offload): which, and what it costs
        gb = stage.streamed_bytes_per_step / 1e9
        ax.text(x + 0.12, top - 1.36, fit_text(f"streams {span_label(stage.stream_layers)} from RAM: "
                                               f"+{duration(stage.stream_time_s)}/mb, {gb:,.0f} GB/step", 62),
                fontsize=7, color="#444444", va="center")
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
    # Each chunk of each stage (one but under an interleaved schedule, whose chunks alternate along the strip).
    pieces = [(first, last, names, send, stage) for stage in stages
              for (first, last), names, send in zip(stage.spans(), [stage.node_names, *(c.node_names for c in stage.chunks)],
                                                    [stage.send_time_s, *(c.send_time_s for c in stage.chunks)],
                                                    strict=True)]
    pieces.sort(key=lambda piece: piece[0])
    for first, last, names, send, stage in pieces:
        x0 = width * first / nodes
        x1 = width * (last + 1) / nodes
        ax.add_patch(Rectangle((x0, y), x1 - x0, h, fc=stage_colour(stage.index), ec="white", lw=1.5))
        label = f"{stage.index}: {span_label(names)}"
        if ax.figure.dpi * (x1 - x0) <= 6 * len(label):  # only when it fits; the boxes above name it anyway
            label = str(stage.index)
        ax.text((x0 + x1) / 2, y + h / 2, label, ha="center", va="center", fontsize=8, color="white")
        if last < nodes - 1:  # the hand-off after it, and its compression (planner.compression; the verdict says why):
            # a device's chunks all hand on in its scheme (planner/search/interleave.py ring_schemes)
            squeezed = f" {stage.compress_out}" if stage.compress_out != "none" else ""
            ax.text(x1, y - 0.25, f"send {duration(send)}{squeezed}", ha="center", va="top", fontsize=7,
                    color="#555555")
