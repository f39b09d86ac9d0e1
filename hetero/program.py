"""Per-stage instruction programs: the schedule as data.

An action is a small typed value with a text form: ``F3`` (forward micro-batch 3), ``B3``, ``RA3``
(receive activation), ``SA3`` (send activation), ``RG3`` (receive gradient), ``SG3`` (send gradient)
and ``STEP`` (clip + optimizer step). The planner generates programs (1F1B, GPipe), its simulator
validates them, the plan stores them as text, and the runtime executes them one by one.

Semantics the runtime and the simulator share:
- Sends are asynchronous (ZeroMQ queues them); receives block until the tensor has arrived.
- Stage 0's ``F`` reads micro-batch ``mb`` of the step's input ids; the last stage's ``F`` also
  computes the loss, and its ``B`` starts from that loss (no ``RG``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Op = Literal["F", "B", "RA", "SA", "RG", "SG", "STEP"]
OPS: tuple[str, ...] = ("F", "B", "RA", "SA", "RG", "SG", "STEP")
_ACTION_RE = re.compile(r"^(RA|SA|RG|SG|F|B)(\d+)$")


@dataclass(frozen=True)
class Action:
    op: str
    mb: int = -1  # micro-batch; -1 for STEP

    def __str__(self) -> str:
        return "STEP" if self.op == "STEP" else f"{self.op}{self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        """Parse the text form; raises ValueError naming the bad token."""
        if text == "STEP":
            return Action("STEP")
        m = _ACTION_RE.match(text)
        if not m:
            raise ValueError(f"not an action: {text!r} (expected F3, B3, RA3, SA3, RG3, SG3 or STEP)")
        return Action(m.group(1), int(m.group(2)))


def format_program(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions]


def parse_program(texts: list[str]) -> list[Action]:
    return [Action.parse(t) for t in texts]
