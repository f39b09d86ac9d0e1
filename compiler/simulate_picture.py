"""simulate.png (drawn by `hetero simulate`): the step's Gantt chart on top, then per stage its memory
over the step against its capacity.

The timeline and the memory curves are the caller's (simulate_plan, whatif.memory_over_time).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from hetero.compiler.picture_style import (
    MEMORY_PARTS,
    MEMORY_WARN_SHARE,
    WARNING_COLOUR,
    memory_share,
    save_figure,
)
from hetero.compiler.schedule_picture import draw_gantt, gantt_legend
from hetero.plan import Plan

if TYPE_CHECKING:
    from hetero.planner.schedule.simulator import Timeline


def memory_axis_limits(points: list[tuple[float, float]], capacity_gb: float) -> tuple[float, float]:
    """y range of a memory-over-time panel: from 0, past both the capacity and the peak, so swings keep scale."""
    peak = max((gb for _, gb in points), default=0.0)
    return 0.0, max(capacity_gb, peak, 1e-9) * 1.08


def draw_simulation(plan: Plan, timeline: Timeline, memory: list[list[tuple[float, float]]],
                    path: str | Path) -> Path:
    """simulate.png: the step's Gantt on top, then per stage its memory over the step against its capacity."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(simulation_figure(plan, timeline, memory), out)


def simulation_figure(plan: Plan, timeline: Timeline, memory: list[list[tuple[float, float]]]) -> Any:
    """The simulate picture as a Figure; ``memory[k]`` is stage k's (time, GB) points (whatif.memory_over_time)."""
    n = len(plan.stages)
    fig, axes = plt.subplots(1 + n, 1, figsize=(11, 1.6 + 0.55 * n + 1.1 * n), sharex=True,
                             gridspec_kw={"height_ratios": [0.6 * n + 0.6] + [1.0] * n})
    gantt = axes[0]
    draw_gantt(gantt, plan, timeline)
    gantt.set_yticks(range(n), [f"stage {k}: {s.device}" for k, s in enumerate(plan.stages)], fontsize=8)
    gantt.set_title(f"{plan.train.schedule}, {plan.train.num_micro_batches} micro-batches: "
                    f"{timeline.step_time_s:.3g} s/step, bubble {timeline.bubble_fraction:.0%}", fontsize=11)
    gantt.legend(*gantt_legend(plan), loc="lower center", bbox_to_anchor=(0.5, 1.12), ncol=6, fontsize=7.5,
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
