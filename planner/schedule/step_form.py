"""A schedule's step algebra in one object: what every solver, bound and search reads about a schedule.

A step form owns, for one pipeline schedule:

- its programs (the generator in planner/schedule/schedules.py);
- ``held``: the micro-batches whose activations a stage holds at its peak, by its position from the
  pipeline's end, and ``helds``: the distinct counts a search prices a stage at;
- its period groups. The closed-form step (``closed_form``, the linear objective of the exact DP and
  the ILP) is the first micro-batch's trip down and back, ``sum_k (f_k + b_k) + 2 sum_k c_k``, plus
  ``(m - 1)`` times, per group, the group's bottleneck: the largest of its weighted stage times
  ``w_f f_k + w_b b_k`` and weighted link times ``w_c c_k``. 1F1B has one group (f + b, 2c: a period
  runs one forward and one backward); GPipe two (the forward phase's f and c, then the backward
  phase's b and c);
- ``alternates``: whether a stage's forward of micro-batch i + held waits for its backward of i (the
  round-trip term of planner/search/simbound.py's lower bound);
- ``chunked``: its form with several chunks of layers per device (``ChunkedForm``; interleaved 1F1B for 1F1B),
  or None. The solvers place one chunk per device under the step form; planner/search/interleave.py deals each
  device's layers into the chunked form's chunks and keeps them where they simulate faster. The chunked form
  owns its programs, its chunk count, when a pipeline cannot run it and the micro-batches a device holds in
  each chunk (``held_counts``), from which its activation peak is priced.

Solvers, bounds and the replica search read these and never a schedule's name. A new schedule is a
generator in planner/schedule/schedules.py and a StepForm registered here (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetero.errors import ConfigError
from hetero.planner.schedule.schedules import gpipe, interleaved_one_f_one_b, one_f_one_b
from hetero.program import SCHEDULES, Action, Op


def linear_step(base: Any, m: int, period: Any) -> Any:
    """The closed form's assembly, written once: ``base`` (the first micro-batch's trip down and back) plus
    (m - 1) times ``period`` (the sum of the groups' bottlenecks). Every solver and bound prices a step, a bound
    or a cut through it: numbers, numpy arrays and PuLP expressions alike."""
    return base + (m - 1) * period


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
class BoundGroup:
    """One max term of a schedule's *lower bound* on the simulated step (``StepForm.bound``): the first
    micro-batch's round trip plus (m - 1) times, per group, the largest stage weight
    ``stage(f, b, held, m)`` or link weight ``link x c``. Unlike the closed form it never exceeds the
    simulator, for any placement, so the least of it over all placements bounds the simulated optimum."""

    stage: Callable[[Any, Any, Any, int], Any]  # (fwd_s, bwd_s, held, m) -> seconds; numbers or numpy arrays
    link: float


@dataclass(frozen=True)
class ChunkedForm:
    """A schedule whose devices hold ``chunks`` chunks of layers each: chunk c of device d of p is virtual stage
    c x p + d of a pipeline of p x chunks, so a micro-batch passes every device ``chunks`` times (the last device
    handing on to the first)."""

    name: str  # as a plan's verdict says it
    chunks: int
    generate: Callable[[int, int, int], list[list[Action]]]  # (devices, micro-batches, chunks) -> programs

    def __post_init__(self) -> None:
        if self.chunks < 2:
            raise ValueError(f"a chunked form holds at least 2 chunks per device, not {self.chunks}")

    def programs(self, num_devices: int, num_micro_batches: int) -> list[list[Action]]:
        """The per-device programs, their actions naming their chunk (planner/schedule/schedules.py)."""
        return self.generate(num_devices, num_micro_batches, self.chunks)

    @staticmethod
    def virtual_stage(device: int, chunk: int, num_devices: int) -> int:
        """The position in the pipeline of ``device``'s chunk ``chunk``: c x p + d, the convention of
        hetero/program.py that the generators, the simulator and runtime/stage/chunks.py share."""
        return chunk * num_devices + device

    def why_not(self, num_devices: int, num_micro_batches: int) -> str | None:
        """Why ``num_devices`` devices cannot run this form at ``num_micro_batches`` (None: they can)."""
        if num_devices < 2:
            return "one stage has no pipeline to interleave"
        if num_micro_batches % num_devices:  # as in Megatron-LM (planner/schedule/schedules.py)
            return (f"interleaving runs micro-batches in groups of the pipeline's {num_devices} devices, and "
                    f"train.num_micro_batches={num_micro_batches} is not a multiple of {num_devices}")
        return None


def held_counts(program: list[Action], chunks: int) -> list[tuple[int, ...]]:
    """The micro-batches a device holds in each chunk after each of its forwards in ``program`` (a forward's
    outputs stay until its backward: runtime/stage/executor.py), those no other count exceeds in every chunk:
    the device's activation peak is the largest of them, weighted by the chunks' bytes per micro-batch."""
    held, seen = [0] * chunks, set()
    for a in program:
        if a.op is Op.F:
            held[a.chunk] += 1
            seen.add(tuple(held))
        elif a.op is Op.B:
            held[a.chunk] -= 1
    return [h for h in seen if not any(o != h and all(x >= y for x, y in zip(o, h, strict=True)) for o in seen)]


def weighted_peak(counts: list[tuple[int, ...]], per_chunk: Sequence[float]) -> float:
    """The largest of the held counts (``held_counts``) weighted by each chunk's bytes per micro-batch."""
    return max((sum(n * b for n, b in zip(held, per_chunk, strict=True)) for held in counts), default=0.0)


def peak_activations(program: list[Action], per_chunk: Sequence[float]) -> float:
    """The most activation bytes a device holds while it runs ``program``: a forward of chunk c adds
    ``per_chunk[c]`` (one micro-batch through that chunk's layers) until its backward frees it. The order of a
    device's own forwards and backwards decides it, whatever the timing."""
    return weighted_peak(held_counts(program, len(per_chunk)), per_chunk)


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
    bound: tuple[BoundGroup, ...]  # the lower bound's max terms (BoundGroup)
    # suffix(trip, f, b, held, m): seconds a stage forces beyond the first micro-batch's round trip, from
    # ``trip``, the sum of it and the stages after it (their f + b, and 2c and messages of the links between):
    # the bound's first group is at least this over (m - 1). Numbers or numpy arrays.
    suffix: Callable[[Any, Any, Any, Any, int], Any]
    chunked: ChunkedForm | None = None  # its form with several chunks per device (planner.interleave), if any

    def programs(self, num_stages: int, num_micro_batches: int) -> list[list[Action]]:
        """The per-stage programs (planner/schedule/schedules.py)."""
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
        return linear_step(base, m, sum(self.periods(fwd_s, bwd_s, comm_s)))

    def least_step(self, m: int, fwd_s: Sequence[float], bwd_s: Sequence[float], comm_s: Sequence[float]) -> float:
        """The lower bound (``bound``) on the simulated step of stages with these times, in pipeline order."""
        s = len(fwd_s)
        base = sum(fwd_s) + sum(bwd_s) + 2.0 * sum(comm_s)
        periods = [max([float(g.stage(f, b, self.held(s - 1 - k, m), m))
                        for k, (f, b) in enumerate(zip(fwd_s, bwd_s, strict=True))] + [g.link * c for c in comm_s])
                   for g in self.bound]
        trip = 0.0  # the round trip of stage k and the stages after it
        for k in range(s - 1, -1, -1):
            trip += fwd_s[k] + bwd_s[k] + (2.0 * comm_s[k] if k < s - 1 else 0.0)
            if m > 1:
                periods[0] = max(periods[0], float(self.suffix(trip, fwd_s[k], bwd_s[k], self.held(s - 1 - k, m), m))
                                 / (m - 1))
        return linear_step(base, m, sum(periods))


def _one_f_one_b_held(position_from_end: int, m: int) -> int:
    return min(position_from_end + 1, m)  # stage k of S holds min(S - k, m)


def _one_f_one_b_bound(fwd_s: Any, bwd_s: Any, held: Any, m: int) -> Any:
    """1F1B's lower-bound weight of a stage: max(f, b, (m - q)/(m - 1) (f + b)) for a stage holding q.

    Chains of events the simulator runs one after another: the last micro-batch's forward waits for the
    stage's m forwards (a flow line: base + (m - 1) f), the first's backward starts its m backwards
    (base + (m - 1) b), and a stage that holds q < m micro-batches waits out its downstream round trip
    twice, after its first forward and before its last backward (base + (m - q) (f + b), planner/search/simbound.py's
    work term with the round trip dropped). The last stage (q = 1) pays (m - 1)(f + b): the closed form's."""
    if m <= 1:
        return np.maximum(fwd_s, bwd_s)
    with np.errstate(invalid="ignore"):  # (m - m) x inf where a stage does not fit: fmax keeps the inf
        return np.fmax(np.maximum(fwd_s, bwd_s), (m - np.asarray(held)) / (m - 1) * (np.asarray(fwd_s) + bwd_s))


def _one_f_one_b_suffix(trip: Any, fwd_s: Any, bwd_s: Any, held: Any, m: int) -> Any:
    """What 1F1B's stage holding q < m micro-batches adds to the step, from its round trip G (planner/search/simbound.py):

    - its forward of micro-batch i + q waits for its backward of i, i.e. for i's trip G: the step runs
      floor((m - 1) / q) more trips after the first, and ((m - 1) mod q) forwards;
    - it waits out the trip after it, G - (f + b), after its first forward and again before its last
      backward, besides its m forwards and backwards: (m - q - 1)(f + b) + G."""
    q = np.asarray(held)
    trips = (m - 1) // q * trip + (m - 1) % q * fwd_s
    return np.where(q < m, np.maximum(trips, (m - q - 1) * (np.asarray(fwd_s) + bwd_s) + trip), 0.0)


def _no_suffix(trip: Any, fwd_s: Any, bwd_s: Any, held: Any, m: int) -> Any:
    return np.zeros_like(np.asarray(trip, dtype=float))


def _forward_phase(fwd_s: Any, bwd_s: Any, held: Any, m: int) -> Any:
    return fwd_s


def _backward_phase(fwd_s: Any, bwd_s: Any, held: Any, m: int) -> Any:
    return bwd_s


def _all_held(position_from_end: int, m: int) -> int:
    return m


# Interleaved 1F1B (Megatron-LM's virtual pipeline, torch's ScheduleInterleaved1F1B) at 2 chunks per device, their
# common choice.
INTERLEAVED = ChunkedForm("interleaved 1F1B", 2, interleaved_one_f_one_b)

FORMS: dict[str, StepForm] = {
    "1f1b": StepForm("1f1b", one_f_one_b, (PeriodGroup(1.0, 1.0, 2.0),), _one_f_one_b_held, by_position=True,
                     alternates=True, torch_class="Schedule1F1B", torch_needs_full_fill=True,
                     bound=(BoundGroup(_one_f_one_b_bound, 1.0),), suffix=_one_f_one_b_suffix,
                     chunked=INTERLEAVED),
    "gpipe": StepForm("gpipe", gpipe, (PeriodGroup(1.0, 0.0, 1.0), PeriodGroup(0.0, 1.0, 1.0)), _all_held,
                      by_position=False, alternates=False, torch_class="ScheduleGPipe", torch_needs_full_fill=False,
                      # GPipe's closed form is the simulator's step (forward phase, then backward phase).
                      bound=(BoundGroup(_forward_phase, 1.0), BoundGroup(_backward_phase, 1.0)), suffix=_no_suffix),
}
# The names live with the programs (hetero/program.py: a plan is checked without importing the planner); they are
# these forms' (tests/unit/test_step_form.py).
assert set(SCHEDULES) == set(FORMS), (SCHEDULES, list(FORMS))


def step_form(schedule: str) -> StepForm:
    """The step form of a named schedule; a one-line ConfigError naming the choices for an unknown one."""
    try:
        return FORMS[schedule.lower()]
    except KeyError:
        raise ConfigError(f"unknown schedule '{schedule}': choose one of {', '.join(SCHEDULES)}") from None


def programs_for(schedule: str, num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """The per-stage programs of a named schedule."""
    return step_form(schedule).programs(num_stages, num_micro_batches)
