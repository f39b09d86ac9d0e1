"""What every picture shares, the compiler's and the run's: one colour per stage, red for warnings, saving.

Torch-free and planner-free, so the runtime (which never imports hetero.compiler) draws its run
pictures in the same style as the compiler's plan pictures. Stages take hues (red and grey left out),
red warns, greys are for memory and idle time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

# Files only: no display on build machines and headless hosts. Every picture module imports this one,
# so the backend is set before any of them makes a figure.
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# tab10 without its red (kept for warnings) and grey (kept for memory and idle time).
STAGE_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
FORWARD_COLOUR, BACKWARD_COLOUR, SEND_COLOUR = "#4C72B0", "#DD8452", "#B0B0B0"
STEP_COLOUR, REDUCE_COLOUR, IDLE_COLOUR = "#2B2B2B", "#D9D9D9", "#F2F2F2"
WARNING_COLOUR, WARNING_TINT = "#B00020", "#FDE8EA"


def stage_colour(k: int) -> str:
    """A distinct colour per stage, shared by every picture."""
    return STAGE_PALETTE[k % len(STAGE_PALETTE)]


def duration(seconds: float) -> str:
    """'1.25 s', '40 ms', '<1 ms', '0 s': a duration as a person reads it off a picture."""
    if seconds <= 0:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 1e-3 else "<1 ms"


def fit_text(text: str, chars: int) -> str:
    """``text`` cut to ``chars`` characters, an ellipsis marking the cut."""
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` and free it; returns the path."""
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
