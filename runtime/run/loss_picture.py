"""loss.png (drawn after `hetero run`, beside steps.png): the training loss of every step the run's metrics.jsonl
holds (a resumed or recovered run's earlier steps included), its moving mean, the held-out ``eval_loss`` where the
run evaluated, and each recovery from a lost device marked.

What is drawn is decided by ``loss_picture_data`` (tested without looking at pixels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hetero.picture_style import STEP_COLOUR, save_figure, stage_colour
from hetero.runtime.run.metrics_file import Line, RunLines

MEAN_OF = 10  # the moving mean's window, in steps (shorter runs: a fifth of their steps)
EVENT_COLOUR = "#555555"


@dataclass
class LossPicture:
    """What loss.png shows, in data: every series is (step numbers, values)."""

    title: str
    steps: list[int]
    loss: list[float]
    mean: list[float]  # moving mean over the last ``window`` steps (fewer at the start)
    window: int
    eval_steps: list[int]
    eval_loss: list[float]
    events: list[tuple[float, str]]  # (x between the steps, label): recoveries


def loss_picture_data(lines: list[Line], title: str) -> LossPicture:
    """loss.png's series from metrics.jsonl lines: each step once (the last line of a step that was trained
    again wins), non-finite losses left out."""
    run = RunLines(lines)
    by_step = {m.step: m.loss for m in run.steps}
    steps = sorted(s for s, v in by_step.items() if math.isfinite(v))
    loss = [by_step[s] for s in steps]
    window = max(1, min(MEAN_OF, len(steps) // 5))
    mean = [sum(loss[max(0, i + 1 - window):i + 1]) / len(loss[max(0, i + 1 - window):i + 1]) for i in range(len(loss))]
    evals = sorted((m.step, m.eval_loss) for m in run.evals if math.isfinite(m.eval_loss))
    events = [(e.after_step + 0.5, f"lost {e.device}") for e in run.recoveries]
    return LossPicture(title, steps, loss, mean, window, [s for s, _ in evals], [v for _, v in evals], events)


def draw_loss(lines: list[Line], path: str | Path, title: str) -> Path:
    """loss.png at ``path`` from a run's metrics.jsonl lines; returns the path."""
    import matplotlib.pyplot as plt  # after hetero.picture_style chose the file-only backend

    data = loss_picture_data(lines, title)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.plot(data.steps, data.loss, color=STEP_COLOUR, lw=0.8, alpha=0.45, label="training loss")
    if data.window > 1:
        ax.plot(data.steps, data.mean, color=STEP_COLOUR, lw=2.0, label=f"mean of the last {data.window} steps")
    if data.eval_steps:
        ax.plot(data.eval_steps, data.eval_loss, color=stage_colour(1), lw=1.6, marker="o", ms=4,
                label="held-out eval_loss")
    for x, label in data.events:
        ax.axvline(x, color=EVENT_COLOUR, lw=1.0, ls=":")
        ax.text(x + 0.15, 0.97, label, transform=ax.get_xaxis_transform(), fontsize=7.5, va="top", ha="left",
                color=EVENT_COLOUR)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(data.title, fontsize=11)
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    ax.tick_params(labelsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out)
