"""A placement's prediction: its stage times run through the schedule's simulator (what a plan reports)."""

from __future__ import annotations

from hetero.plan import Prediction
from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Evaluation
from hetero.planner.schedule.simulator import Timeline, simulate
from hetero.planner.schedule.step_form import programs_for


def predict(table: CostTable, evaluation: Evaluation) -> tuple[Prediction, Timeline]:
    """Simulate the schedule on a placement's stage times: the numbers a plan reports."""
    num_stages = len(evaluation.placement.devices)
    programs = programs_for(table.schedule, num_stages, table.num_micro_batches)
    timeline = simulate(programs, evaluation.fwd_s, evaluation.bwd_s, evaluation.send_s,
                        overhead_s=evaluation.overhead_s or None, sync_s=evaluation.sync_s or None,
                        cores=evaluation.cores)
    tokens = table.tokens * table.num_micro_batches
    step = timeline.step_time_s
    prediction = Prediction(
        step_time_s=step,
        tokens_per_step=tokens,
        tokens_per_s=tokens / step if step > 0 else 0.0,
        bubble_fraction=timeline.bubble_fraction,
        stage_busy=timeline.busy_fraction,
        stage_memory_gb=[mem.total_gb for mem in evaluation.memory],
    )
    return prediction, timeline

