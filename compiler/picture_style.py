"""What every picture of a plan shares: one meaning per colour, the labels of a stage, saving a figure.

Stages take hues (red and grey left out), memory parts greys with hatching, red warns (a device past
90% of its usable memory, the step line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

# Files only: no display on build machines and headless hosts. Every picture module imports this one,
# so the backend is set before any of them makes a figure.
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

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
