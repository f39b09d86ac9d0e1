"""A run cut at its rebalancing moves: each stretch of steps on one split, with the prediction for that split.

The plan predicts the steps before the first move; a move's event line (metrics.jsonl, ``"event":
"rebalance"``) carries the prediction for the split it moves to (``predicted_step_s_after``,
``predicted_stage_s_after``: per stage compute seconds per step, forward + backward). A move is judged by the median step
time of the few steps before it against the few after it, the move's own step left out (it also
holds the move and the new layers' first step). Torch-free; the report, `hetero simulate --run` and
steps.png read the same segments.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from hetero.plan import Plan
from hetero.runtime.run.metrics_file import RebalanceEvent, StepLine

GAIN_WINDOW = 4  # steps either side of a move that its measured gain is the median of


@dataclass(frozen=True)
class Segment:
    """Consecutive steps that ran on one split, and what was predicted for that split."""

    steps: list[StepLine]  # metrics.jsonl step lines, in step order
    split: list[int] | None  # decoder layers per stage
    predicted_step_s: float | None
    predicted_compute_s: list[float] | None  # per stage: forward + backward seconds per step
    move: RebalanceEvent | None = None  # the event that started it; None: the plan's own split

    @property
    def measured(self) -> list[StepLine]:
        """The steps that measure this split: the first left out (warm-up, or the move's own step)."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    @property
    def first_step(self) -> int | None:
        return self.steps[0].step if self.steps else None

    @property
    def last_step(self) -> int | None:
        return self.steps[-1].step if self.steps else None

    def median_step_s(self) -> float | None:
        """Measured step time on this split (median of ``measured``)."""
        return _median([s.step_time_s for s in self.measured])

    def median_busy_s(self, k: int) -> float | None:
        """Stage k's measured busy seconds per step (F + B + optimizer) on this split (median of ``measured``)."""
        return _median([s.stage_busy[k] for s in self.measured if k < len(s.stage_busy)])

    def median_compute_s(self, k: int) -> float | None:
        """Stage k's measured forward + backward seconds per step on this split (median of ``measured``)."""
        return _median([compute_s(s.stage_ops[k]) for s in self.measured if k < len(s.stage_ops)])


def compute_s(ops: dict[str, float]) -> float:
    """A stage's forward + backward seconds in one step's (or a median step's) ``stage_ops``."""
    return float(ops.get("F", 0.0)) + float(ops.get("B", 0.0))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def plan_split(plan: Plan) -> list[int]:
    """Decoder layers per stage as the plan placed them."""
    return [sum(1 for names in [sp.node_names, *(c.node_names for c in sp.chunks)] for n in names
                if n.startswith("layers.")) for sp in plan.stages]


def plan_compute_s(plan: Plan) -> list[float]:
    """Per stage, the plan's forward + backward seconds per step (its replica's share of the micro-batches)."""
    return [plan.micro_batches_of(k) * sp.compute_s() for k, sp in enumerate(plan.stages)]


def plan_busy_s(plan: Plan) -> list[float]:
    """Per stage, the plan's busy seconds per step as a stage measures them: compute and the optimizer."""
    return [c + sp.overhead_s.get("STEP", 0.0) for c, sp in zip(plan_compute_s(plan), plan.stages, strict=True)]


def run_segments(plan: Plan, steps: list[StepLine], events: list[RebalanceEvent]) -> list[Segment]:
    """``steps`` cut after each move's ``after_step``: the first segment is the plan's split, each next one
    the split its move went to (a move after the last step still makes a segment, with no steps)."""
    moves = sorted(events, key=lambda e: e.after_step)
    bounds: list[int | None] = [e.after_step for e in moves] + [None]
    segments, low = [], None
    for i, high in enumerate(bounds):
        inside = [s for s in steps if (low is None or s.step > low) and (high is None or s.step <= high)]
        if i == 0:
            segments.append(Segment(inside, plan_split(plan), plan.prediction.step_time_s, plan_compute_s(plan)))
        else:
            move = moves[i - 1]
            segments.append(Segment(inside, move.new_split, move.predicted_step_s_after, move.predicted_stage_s_after,
                                    move))
        low = high
    return segments


def measured_gain(before: Segment, after: Segment) -> tuple[float | None, list[StepLine], list[StepLine]]:
    """Median step time of up to GAIN_WINDOW steps before a move over that of the steps after it (the
    move's own step, the first after it, left out); with the steps each median was taken over."""
    ahead = before.measured[-GAIN_WINDOW:]
    behind = after.steps[1:1 + GAIN_WINDOW]
    slow = _median([s.step_time_s for s in ahead])
    fast = _median([s.step_time_s for s in behind])
    gain = slow / fast if slow is not None and fast else None
    return gain, ahead, behind


def _span(lines: list[StepLine]) -> list[int] | None:
    return [lines[0].step, lines[-1].step] if lines else None


def run_moves(segments: list[Segment]) -> list[dict[str, Any]]:
    """Each move of the run: the device that changed speed and by how much, old and new split, predicted
    and measured gain (median step time before over after, steps named)."""
    out = []
    for before, after in zip(segments, segments[1:], strict=False):
        event = after.move
        assert event is not None  # every segment after the first starts with its move
        gain, ahead, behind = measured_gain(before, after)
        out.append({
            "after_step": event.after_step, "stage": event.cause.stage, "device": event.cause.device,
            "slowdown": event.cause.slowdown, "reason": event.cause.reason,
            "old_split": event.old_split, "new_split": event.new_split,
            "predicted_step_s_before": event.predicted_step_s_before,
            "predicted_step_s_after": event.predicted_step_s_after,
            "predicted_gain": event.predicted_gain, "measured_gain": gain,
            "measured_step_s_before": _median([s.step_time_s for s in ahead]),
            "measured_step_s_after": _median([s.step_time_s for s in behind]),
            "steps_before": _span(ahead), "steps_after": _span(behind), "move_s": event.move_s, "plan": event.plan,
        })
    return out


def across_plans(move: dict[str, Any], steps: list[StepLine]) -> dict[str, Any]:
    """A re-plan move (``plan`` set: runtime/run/replan_moves.py) measured over the whole run's ``steps``: the steps
    before it ran under the plan before, in another coordinator, so this run's own segments cannot see them."""
    if move.get("plan") is None or move.get("measured_gain") is not None:
        return move
    after = move["after_step"]
    ahead = [s for s in steps if s.step <= after][-GAIN_WINDOW:]
    behind = [s for s in steps if s.step > after][1:1 + GAIN_WINDOW]  # the first step after it left out
    slow, fast = _median([s.step_time_s for s in ahead]), _median([s.step_time_s for s in behind])
    return {**move, "measured_gain": slow / fast if slow is not None and fast else None,
            "measured_step_s_before": slow, "measured_step_s_after": fast,
            "steps_before": _span(ahead), "steps_after": _span(behind)}


def split_text(split: Any) -> str:
    """'4/4' for a split of decoder layers per stage; '?' when the line does not say."""
    return "/".join(str(x) for x in split) if isinstance(split, list) and split else "?"


def _gain_text(gain: float | None) -> str:
    return "-" if gain is None else f"{gain:.2f}x"


def move_line(move: dict[str, Any]) -> str:
    """One move in words: cause, old -> new split, predicted and measured gain, what the move cost."""
    who = move.get("device") or "a device"
    if move.get("stage") is not None:
        who += f" (stage {move['stage']})"
    slower = f" {move['slowdown']:.2g}x slower" if move.get("slowdown") is not None else " changed speed"
    reason = f" ({move['reason']})" if move.get("reason") else ""
    measured = _gain_text(move.get("measured_gain"))
    if move.get("measured_gain") is not None:
        before, after = move["steps_before"], move["steps_after"]
        measured += (f" (median step {move['measured_step_s_before']:.4g} s over steps {before[0]}-{before[1]} -> "
                     f"{move['measured_step_s_after']:.4g} s over steps {after[0]}-{after[1]})")
    else:
        measured += " (too few steps on one side of the move)"
    cost = f"; the move took {move['move_s']:.3g} s" if move.get("move_s") is not None else ""
    return (f"after step {move.get('after_step')}: {who}{slower}{reason}; split {split_text(move.get('old_split'))}"
            f" -> {split_text(move.get('new_split'))}; gain predicted {_gain_text(move.get('predicted_gain'))}, "
            f"measured {measured}{cost}")
