"""Pictures of a plan: where the layers go (placement.png) and how a step unfolds in time (schedule.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on build machines and headless hosts
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

from hetero.plan import Plan  # noqa: E402

MEMORY_PARTS = (  # (MemoryBreakdown field, legend label, colour)
    ("weights_gb", "weights", "#4C72B0"),
    ("lora_gb", "LoRA + optimizer", "#55A868"),
    ("activations_gb", "activations", "#DD8452"),
    ("workspace_gb", "workspace", "#8C8C8C"),
)
FORWARD_COLOUR, BACKWARD_COLOUR, SEND_COLOUR = "#4C72B0", "#DD8452", "#B0B0B0"
_HOST_W, _HOST_GAP, _DEV_H, _HEADER = 4.6, 2.2, 2.5, 0.8


def stage_colour(k: int) -> Any:
    """A distinct colour per stage, shared by both pictures."""
    return plt.get_cmap("tab10")(k % 10)


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
        ax.add_patch(
            FancyBboxPatch(
                (x, 0),
                _HOST_W,
                host_h,
                boxstyle="round,pad=0.05,rounding_size=0.15",
                fc="#F4F4F4",
                ec="#555555",
                lw=1.5,
            )
        )
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
    handles = [Rectangle((0, 0), 1, 1, fc=c) for _, _, c in MEMORY_PARTS]
    ax.legend(
        handles,
        [f"memory: {label}" if i == 0 else label for i, (_, label, _) in enumerate(MEMORY_PARTS)],
        loc="upper right",
        ncol=4,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(1.0, 0.0),
    )
    ax.set_title(_title(plan), fontsize=12)
    return fig


def _draw_device(ax: Any, plan: Plan, device: Any, stage: Any, x: float, y: float) -> None:
    w, h = _HOST_W - 0.3, _DEV_H - 0.2
    colour = stage_colour(stage.index) if stage is not None else "#CCCCCC"
    ax.add_patch(
        FancyBboxPatch(
            (x, y + 0.1),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            fc="white",
            ec=colour,
            lw=2.5 if stage is not None else 1.0,
        )
    )
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
    ax.text(x + 1.0, top - 0.3, _fit(device.display_name, 34), fontsize=8.5, va="center")
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
    # Memory bar: full width = usable memory (device memory less the headroom the planner keeps free).
    mem = stage.memory
    bar_x, bar_y, bar_w, bar_h = x + 0.12, y + 0.3, w - 0.24, 0.36
    ax.add_patch(Rectangle((bar_x, bar_y), bar_w, bar_h, fc="#EEEEEE", ec="#999999", lw=0.8))
    scale = bar_w / max(mem.available_gb, mem.total_gb, 1e-9)
    left = bar_x
    for field, _, c in MEMORY_PARTS:
        part = getattr(mem, field) * scale
        ax.add_patch(Rectangle((left, bar_y), part, bar_h, fc=c, ec="none"))
        left += part
    over = mem.total_gb > mem.available_gb
    ax.text(
        bar_x,
        bar_y + bar_h + 0.14,
        f"memory {mem.total_gb:.1f} / {mem.available_gb:.1f} GB usable",
        fontsize=8,
        va="center",
        color="#B00020" if over else "#333333",
    )


def _duration(seconds: float) -> str:
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
            ax.add_patch(
                FancyArrowPatch(
                    (xa, host_h + 0.05),
                    (xb, host_h + 0.05),
                    arrowstyle="-",
                    lw=1.5,
                    color="#333333",
                    connectionstyle=f"arc3,rad={-0.12 / gap}",
                )
            )
            ax.text(
                (xa + xb) / 2,
                host_h + 0.25 + 0.35 * gap,
                label,
                ha="center",
                fontsize=8,
                bbox=dict(fc="white", ec="none", pad=1),
            )


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
        if ax.figure.dpi * (x1 - x0) > 6 * len(label):  # only when it fits; the boxes above name it anyway
            ax.text((x0 + x1) / 2, y + h / 2, label, ha="center", va="center", fontsize=8, color="white")
        else:
            ax.text(
                (x0 + x1) / 2,
                y + h / 2,
                str(stage.index),
                ha="center",
                va="center",
                fontsize=8,
                color="white",
            )
        if stage is not stages[-1]:
            ax.text(
                x1,
                y - 0.25,
                f"send {_duration(stage.send_time_s)}",
                ha="center",
                va="top",
                fontsize=7,
                color="#555555",
            )


def draw_schedule(plan: Plan, path: str | Path, timeline: Any = None) -> Path:
    """Gantt chart of the simulated step: one row per stage, F/B boxes per micro-batch, step time marked."""
    return _save(schedule_figure(plan, timeline), path)


def schedule_figure(plan: Plan, timeline: Any = None) -> Any:
    """The schedule Gantt chart as a Figure; ``timeline`` defaults to simulate_plan(plan)."""
    if timeline is None:
        from hetero.planner.simulator import simulate_plan

        timeline = simulate_plan(plan)
    n = len(plan.stages)
    step = timeline.step_time_s
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.75 * n + 1.2))
    for k in range(n):
        ax.add_patch(Rectangle((0, k - 0.4), step, 0.8, fc="#F2F2F2", ec="none"))  # idle shows as grey
    min_label_w = step / 90  # about the width of two characters at this figure size
    for e in timeline.events:
        if e.op in ("F", "B"):
            colour = FORWARD_COLOUR if e.op == "F" else BACKWARD_COLOUR
            ax.add_patch(
                Rectangle(
                    (e.start_s, e.stage - 0.35), e.end_s - e.start_s, 0.7, fc=colour, ec="white", lw=0.6
                )
            )
            if e.end_s - e.start_s > min_label_w:
                ax.text(
                    (e.start_s + e.end_s) / 2,
                    e.stage,
                    f"{e.op}{e.mb}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        elif e.op in ("SA", "SG") and e.end_s > e.start_s:
            # Transfers: a thin bar under the sending stage's row, on the link while in flight.
            ax.add_patch(
                Rectangle((e.start_s, e.stage + 0.37), e.end_s - e.start_s, 0.06, fc=SEND_COLOUR, ec="none")
            )
    ax.axvline(step, color="#B00020", ls="--", lw=1.2)
    ax.text(step, -0.75, f" step {step:.3g} s", color="#B00020", fontsize=9, va="center")
    labels = []
    for k, s in enumerate(plan.stages):
        busy = timeline.busy_fraction[k] if k < len(timeline.busy_fraction) else 0.0
        replica = f" (replica {plan.replica_of(k)[0]})" if plan.replicas else ""
        labels.append(f"stage {k}{replica}: {s.device}\n{span_label(s.node_names)}  ({busy:.0%} busy)")
    ax.set_yticks(range(n), labels, fontsize=8)
    ax.set_ylim(n - 0.4, -1.0)
    ax.set_xlim(0, step * 1.08)
    ax.set_xlabel("seconds into the step")
    handles = [
        Rectangle((0, 0), 1, 1, fc=c) for c in (FORWARD_COLOUR, BACKWARD_COLOUR, SEND_COLOUR, "#F2F2F2")
    ]
    ax.legend(
        handles,
        ["forward (micro-batch)", "backward", "send", "idle"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    replicas = f"{len(plan.replicas)} replicas, " if plan.replicas else ""
    ax.set_title(
        f"{plan.schedule} schedule, {replicas}{plan.train.num_micro_batches} micro-batches of {plan.train.micro_batch_size} "
        f"x {plan.model.seq_len} tokens: step {step:.3g} s, bubble {timeline.bubble_fraction:.0%}",
        fontsize=11,
    )
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    return fig
