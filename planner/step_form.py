"""A schedule's step algebra in one object: what every solver, bound and search reads about a schedule.

A step form owns, for one pipeline schedule:

- its programs (the generator in planner/schedules.py);
- ``held``: the micro-batches whose activations a stage holds at its peak, by its position from the
  pipeline's end, and ``helds``: the distinct counts a search prices a stage at;
- its period groups. The closed-form step (``closed_form``, the linear objective of the exact DP and
  the ILP) is the first micro-batch's trip down and back, ``sum_k (f_k + b_k) + 2 sum_k c_k``, plus
  ``(m - 1)`` times, per group, the group's bottleneck: the largest of its weighted stage times
  ``w_f f_k + w_b b_k`` and weighted link times ``w_c c_k``. 1F1B has one group (f + b, 2c: a period
  runs one forward and one backward); GPipe two (the forward phase's f and c, then the backward
  phase's b and c);
- ``alternates``: whether a stage's forward of micro-batch i + held waits for its backward of i (the
  round-trip term of planner/simbound.py's lower bound).

Solvers, bounds and the replica search read these and never a schedule's name. A new schedule is a
generator in planner/schedules.py and a StepForm registered here (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetero.errors import ConfigError
from hetero.planner.schedules import gpipe, one_f_one_b
from hetero.program import Action


@dataclass(frozen=True)
class PeriodGroup:
    """One max term of the closed form: weights of a stage's forward and backward seconds and of a link's."""

    fwd: float
    bwd: float
    link: float

    def stage(self, fwd_s: float, bwd_s: float) -> float:
        """A stage's weighted time in this group (works on numbers and numpy arrays alike)."""
        # A zero weight leaves its term out (0 x inf would be nan where a stage does not fit).
        return (self.fwd * fwd_s if self.fwd else 0.0) + (self.bwd * bwd_s if self.bwd else 0.0)


@dataclass(frozen=True)
class StepForm:
    """One schedule's step algebra (the module docstring)."""

    name: str
    generate: Callable[[int, int], list[list[Action]]]
    groups: tuple[PeriodGroup, ...]
    # held(position_from_end, m): micro-batches a stage holds at its peak (position 0 is the last stage).
    held: Callable[[int, int], int]
    by_position: bool  # whether ``held`` depends on the position (else every stage holds held(0, m))
    alternates: bool  # a stage's forward of micro-batch i + held waits for its own backward of i
    torch_class: str  # torch.distributed.pipelining's class for it (--engine torch)
    torch_needs_full_fill: bool  # torch's class needs at least one micro-batch per stage

    def programs(self, num_stages: int, num_micro_batches: int) -> list[list[Action]]:
        """The per-stage programs (planner/schedules.py)."""
        return self.generate(num_stages, num_micro_batches)

    def helds(self, m: int, most_stages: int) -> list[int]:
        """The distinct micro-batch counts a stage can hold in pipelines of at most ``most_stages`` stages, ascending."""
        if not self.by_position:
            return [self.held(0, m)]
        return sorted({self.held(p, m) for p in range(max(1, most_stages))})

    def slot(self, position_from_end: int, m: int, most_stages: int) -> int:
        """The index into ``helds(m, most_stages)`` of the count a stage holds at this position."""
        return self.helds(m, most_stages).index(self.held(position_from_end, m))

    def most_held(self, m: int, most_stages: int) -> int:
        """The most micro-batches any stage holds in pipelines of at most ``most_stages`` stages."""
        return max(self.helds(m, most_stages))

    @property
    def link_weight(self) -> float:
        """A link's largest weight in any period group (what one link costs a single-period heuristic)."""
        return max(g.link for g in self.groups)

    def periods(self, fwd_s: Sequence[float], bwd_s: Sequence[float], comm_s: Sequence[float]) -> list[float]:
        """Each group's bottleneck for these stage and link times (``comm_s[k]``: stage k to k + 1)."""
        return [max([g.stage(f, b) for f, b in zip(fwd_s, bwd_s, strict=True)] + [g.link * c for c in comm_s])
                for g in self.groups]

    def closed_form(self, m: int, fwd_s: Sequence[float], bwd_s: Sequence[float], comm_s: Sequence[float]) -> float:
        """The linear step time: first micro-batch's round trip plus (m - 1) times the groups' bottlenecks."""
        base = sum(fwd_s) + sum(bwd_s) + 2.0 * sum(comm_s)
        return base + (m - 1) * sum(self.periods(fwd_s, bwd_s, comm_s))


def _one_f_one_b_held(position_from_end: int, m: int) -> int:
    return min(position_from_end + 1, m)  # stage k of S holds min(S - k, m)


def _all_held(position_from_end: int, m: int) -> int:
    return m


FORMS: dict[str, StepForm] = {
    "1f1b": StepForm("1f1b", one_f_one_b, (PeriodGroup(1.0, 1.0, 2.0),), _one_f_one_b_held, by_position=True,
                     alternates=True, torch_class="Schedule1F1B", torch_needs_full_fill=True),
    "gpipe": StepForm("gpipe", gpipe, (PeriodGroup(1.0, 0.0, 1.0), PeriodGroup(0.0, 1.0, 1.0)), _all_held,
                      by_position=False, alternates=False, torch_class="ScheduleGPipe", torch_needs_full_fill=False),
}
SCHEDULES: tuple[str, ...] = tuple(FORMS)


def step_form(schedule: str) -> StepForm:
    """The step form of a named schedule; a one-line ConfigError naming the choices for an unknown one."""
    try:
        return FORMS[schedule.lower()]
    except KeyError:
        raise ConfigError(f"unknown schedule '{schedule}': choose one of {', '.join(SCHEDULES)}") from None


def programs_for(schedule: str, num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """The per-stage programs of a named schedule."""
    return step_form(schedule).programs(num_stages, num_micro_batches)
