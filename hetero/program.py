"""Per-stage instruction programs: the schedule as data.

An action is a small typed value with a text form: ``F3`` (forward micro-batch 3), ``B3``, ``RA3``
(receive activation), ``SA3`` (send activation), ``RG3`` (receive gradient), ``SG3`` (send gradient)
and ``STEP`` (clip + optimizer step). Under an interleaved schedule a device holds several chunks of
layers (virtual stages) and an action names its chunk: ``F3@1`` is the forward of micro-batch 3
through the device's chunk 1 (chunk 0 is written without ``@``). Chunk c of device d is virtual stage
``c * devices + d``: activations go from virtual stage j to j + 1, so the last device's chunk c hands
on to the first device's chunk c + 1. The planner generates programs (1F1B, GPipe), its simulator
validates them, the plan stores them as text, and the runtime executes them one by one.
``parse_program`` is the one parser of the text form; everything that reads a stored program goes
through it (a plan's stage: ``StagePlan.actions()``).

Semantics the runtime and the simulator share:
- Sends are asynchronous (ZeroMQ queues them); receives block until the tensor has arrived.
- Stage 0's ``F`` reads micro-batch ``mb`` of the step's input ids; the last stage's ``F`` also
  computes the loss, and its ``B`` starts from that loss (no ``RG``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

# The schedules a plan may name (train.schedule): each is a step form of planner/schedule/step_form.py, which checks that
# the two lists agree. Here, with the programs, so that checking a plan does not import the planner.
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")


class Op(str, Enum):
    """What an action does. A ``str`` enum: ``Op.F == "F"``, and it prints as its text form."""

    F = "F"  # forward one micro-batch
    B = "B"  # backward one micro-batch
    RA = "RA"  # receive an activation from the previous stage
    SA = "SA"  # send an activation to the next stage
    RG = "RG"  # receive a gradient from the next stage
    SG = "SG"  # send a gradient to the previous stage
    STEP = "STEP"  # clip by the global gradient norm, optimizer step

    def __str__(self) -> str:
        return self.value


OPS: tuple[str, ...] = tuple(op.value for op in Op)
_ACTION_RE = re.compile(r"^(RA|SA|RG|SG|F|B)(\d+)(?:@(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One instruction of a stage's program: ``op`` on micro-batch ``mb`` (-1 for STEP) through ``chunk``."""

    op: Op
    mb: int = -1  # micro-batch; -1 for STEP
    chunk: int = 0  # the device's chunk of layers (virtual stage chunk x devices + device); 0 but interleaved

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):  # Action("F", 3) reads as well as Action(Op.F, 3)
            try:
                object.__setattr__(self, "op", Op(self.op))
            except ValueError:
                raise ValueError(f"not an action op: {self.op!r} (expected one of {', '.join(OPS)})") from None

    def __str__(self) -> str:
        if self.op is Op.STEP:
            return "STEP"
        return f"{self.op.value}{self.mb}" + (f"@{self.chunk}" if self.chunk else "")

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the text form; raises ValueError naming the bad token."""
        if text == "STEP":
            return Action(Op.STEP)
        m = _ACTION_RE.match(text) if isinstance(text, str) else None
        if not m:
            raise ValueError(f"not an action: {text!r} (expected F3, B3, RA3, SA3, RG3, SG3, F3@1 or STEP)")
        return Action(Op(m.group(1)), int(m.group(2)), int(m.group(3) or 0))


def format_program(actions: Iterable[Action]) -> list[str]:
    """The text form of a program, as plan.json stores it."""
    return [str(a) for a in actions]


def parse_program(texts: Iterable[str]) -> list[Action]:
    """The one parser of stored programs; raises ValueError naming the first bad token."""
    return [Action.parse(t) for t in texts]
