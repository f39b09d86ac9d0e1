"""What every picture of a plan shares: one meaning per colour, the labels of a stage, saving a figure.

Stages take hues (red and grey left out), memory parts greys with hatching, red warns (a device past
90% of its usable memory, the step line). The colours, durations and saving are hetero/picture_style.py's,
shared with the run's pictures (the runtime may not import the compiler).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.picture_style import (  # shared with the run's pictures (runtime/run/steps_picture.py)
    BACKWARD_COLOUR,
    FORWARD_COLOUR,
    IDLE_COLOUR,
    REDUCE_COLOUR,
    SEND_COLOUR,
    STAGE_PALETTE,
    STEP_COLOUR,
    WARNING_COLOUR,
    WARNING_TINT,
    duration,
    fit_text,
    save_figure,
    stage_colour,
)
from hetero.plan import MemoryBreakdown, Plan

__all__ = [
    "BACKWARD_COLOUR", "FORWARD_COLOUR", "IDLE_COLOUR", "MEMORY_PARTS", "MEMORY_WARN_SHARE", "REDUCE_COLOUR",
    "SEND_COLOUR", "STAGE_PALETTE", "STEP_COLOUR", "WARNING_COLOUR", "WARNING_TINT", "MemoryPart", "crowded_stages",
    "duration", "fit_text", "memory_share", "save_figure", "span_label", "stage_colour",
]


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
MEMORY_WARN_SHARE = 0.9  # a device above this share of its usable memory is drawn in red


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
