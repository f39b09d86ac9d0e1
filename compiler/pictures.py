"""Pictures of a plan: where the layers go (placement.png), how a step unfolds in time (schedule.png),
and the step with each stage's memory over it (simulate.png, drawn by `hetero simulate`).

The drawing lives in one module per picture (placement_picture, schedule_picture, simulate_picture)
over a shared style (picture_style: one meaning per colour); this module is their public face.
The timed pictures draw the caller's timeline (and memory curves): nothing here simulates.
"""

from __future__ import annotations

from hetero.compiler.picture_style import (
    BACKWARD_COLOUR,
    FORWARD_COLOUR,
    IDLE_COLOUR,
    MEMORY_PARTS,
    MEMORY_WARN_SHARE,
    REDUCE_COLOUR,
    SEND_COLOUR,
    STAGE_PALETTE,
    STEP_COLOUR,
    WARNING_COLOUR,
    WARNING_TINT,
    MemoryPart,
    crowded_stages,
    memory_share,
    span_label,
    stage_colour,
)
from hetero.compiler.placement_picture import draw_placement, placement_figure
from hetero.compiler.schedule_picture import Block, draw_schedule, schedule_blocks, schedule_figure
from hetero.compiler.simulate_picture import draw_simulation, memory_axis_limits, simulation_figure

__all__ = [
    "BACKWARD_COLOUR", "FORWARD_COLOUR", "IDLE_COLOUR", "MEMORY_PARTS", "MEMORY_WARN_SHARE", "REDUCE_COLOUR",
    "SEND_COLOUR", "STAGE_PALETTE", "STEP_COLOUR", "WARNING_COLOUR", "WARNING_TINT", "Block", "MemoryPart",
    "crowded_stages", "draw_placement", "draw_schedule", "draw_simulation", "memory_axis_limits",
    "memory_share", "placement_figure", "schedule_blocks", "schedule_figure", "simulation_figure",
    "span_label", "stage_colour",
]
