"""Discrete-event simulator of per-stage programs: validates a schedule and predicts its step time.

Semantics are those of hetero.program (and of the runtime): sends are asynchronous, receives
block. Each directed link (stage k -> k+1 for activations, k+1 -> k for gradients) carries one
tensor at a time, in the sender's program order, each taking ``send_s[k]``; the two directions do
not share time (full-duplex NIC / PCIe). Compute is serial on a stage. Besides compute, an action
may cost its stage ``overhead_s[k][op]`` seconds: the CPU time of encoding a message (SA/SG,
before it goes on the link) or of decoding one (RA/RG, after it arrived), and the optimizer step
(STEP). STEP is a barrier, as in the runtime: every stage's gradient norm goes to the coordinator,
which answers with the clip coefficient, so no stage steps before all have finished their last
backward, plus its round trip ``sync_s[k]``. Without overheads all of these take no time.

Because sends never block and each receive names exactly one tensor, the result does not depend
on the order in which stages are advanced, so the simulator just advances every stage as far as it
can and repeats; if no stage can move and some are unfinished, the programs deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.program import Action, parse_program


class ScheduleError(PlanError):
    """A per-stage program is invalid: deadlock, missing/duplicate work, unmatched send."""


@dataclass(frozen=True)
class Event:
    stage: int
    op: str  # F, B, RA, RG (the wait), SA, SG (on the link: queued start to arrival), STEP
    mb: int
    start_s: float
    end_s: float


@dataclass
class Timeline:
    events: list[Event]
    step_time_s: float
    busy_fraction: list[float]  # per stage: compute (F+B) time / step time
    bubble_fraction: float  # 1 - mean busy fraction: idle share of the pipeline's device-time
    peak_in_flight: list[int] = field(default_factory=list)  # per stage: most micro-batches forwarded, not yet backwarded

    def stage_events(self, stage: int, ops: tuple[str, ...] = ("F", "B")) -> list[Event]:
        """The events of one stage (by default its compute), in time order."""
        return sorted((e for e in self.events if e.stage == stage and e.op in ops), key=lambda e: e.start_s)


def _name(k: int, a: Action) -> str:
    return f"stage {k}: {a}"


def _validate_static(programs: list[list[Action]]) -> int:
    """Structural checks that need no timing; returns the number of micro-batches."""
    if not programs:
        raise ScheduleError("no stage programs to simulate")
    num_stages = len(programs)
    mbs0 = sorted(a.mb for a in programs[0] if a.op == "F")
    m = len(mbs0)
    if m == 0 or mbs0 != list(range(m)):
        raise ScheduleError(f"stage 0 must run F0..F{max(m - 1, 0)} once each, found forwards {mbs0}")
    expected = list(range(m))
    for k, prog in enumerate(programs):
        if not prog or prog[-1].op != "STEP" or sum(a.op == "STEP" for a in prog) != 1:
            raise ScheduleError(f"stage {k}: the program must end with exactly one STEP")
        for op in ("F", "B"):
            got = sorted(a.mb for a in prog if a.op == op)
            if got != expected:
                missing = sorted(set(expected) - set(got))
                dup = sorted({mb for mb in got if got.count(mb) > 1})
                extra = sorted(set(got) - set(expected))
                raise ScheduleError(
                    f"stage {k}: every micro-batch needs exactly one {op}; missing {missing}, "
                    f"duplicated {dup}, unknown {extra}"
                )
        for a in prog:
            if a.op in ("RA", "SG") and k == 0:
                raise ScheduleError(f"{_name(k, a)}: the first stage has no previous stage")
            if a.op in ("SA", "RG") and k == num_stages - 1:
                raise ScheduleError(f"{_name(k, a)}: the last stage has no next stage")
            if a.op not in ("STEP",) and not 0 <= a.mb < m:
                raise ScheduleError(f"{_name(k, a)}: micro-batch out of range 0..{m - 1}")
        for op in ("RA", "SA", "RG", "SG"):
            got = [a.mb for a in prog if a.op == op]
            if len(set(got)) != len(got):
                raise ScheduleError(f"stage {k}: a micro-batch is {op}'d twice")
    # Every send must be matched by the neighbour's receive (and vice versa), so nothing is left
    # queued and no receive waits forever for a tensor nobody sends.
    for k in range(num_stages - 1):
        sa = {a.mb for a in programs[k] if a.op == "SA"}
        ra = {a.mb for a in programs[k + 1] if a.op == "RA"}
        if sa != ra:
            raise ScheduleError(
                f"stages {k}->{k + 1}: activations sent {sorted(sa)} but received {sorted(ra)}"
            )
        rg = {a.mb for a in programs[k] if a.op == "RG"}
        sg = {a.mb for a in programs[k + 1] if a.op == "SG"}
        if rg != sg:
            raise ScheduleError(f"stages {k + 1}->{k}: gradients sent {sorted(sg)} but received {sorted(rg)}")
    return m


def simulate(
    programs: list[list[Action]], fwd_s: list[float], bwd_s: list[float], send_s: list[float], *,
    overhead_s: list[dict[str, float]] | None = None, sync_s: list[float] | None = None,
) -> Timeline:
    """Run the programs on a model of the pipeline; raise ScheduleError if they are invalid."""
    num_stages = len(programs)
    if not (len(fwd_s) == len(bwd_s) == num_stages and len(send_s) >= num_stages - 1):
        raise ScheduleError(
            f"{num_stages} programs need {num_stages} fwd/bwd times and {num_stages - 1} send times, "
            f"got {len(fwd_s)}, {len(bwd_s)}, {len(send_s)}"
        )
    over = list(overhead_s) if overhead_s else [{} for _ in range(num_stages)]
    sync = list(sync_s) if sync_s else [0.0] * num_stages
    if len(over) != num_stages or len(sync) != num_stages:
        raise ScheduleError(f"{num_stages} programs need {num_stages} overhead and sync entries, "
                            f"got {len(over)} and {len(sync)}")
    _validate_static(programs)
    last = num_stages - 1

    pc = [0] * num_stages
    clock = [0.0] * num_stages
    # Arrival time of tensors at their receiver: act[(k, mb)] arrives at stage k, grad[(k, mb)] too.
    act_arrival: dict[tuple[int, int], float] = {}
    grad_arrival: dict[tuple[int, int], float] = {}
    fwd_link_free = [0.0] * num_stages  # link k -> k+1
    bwd_link_free = [0.0] * num_stages  # link k -> k-1
    received_act: list[set[int]] = [set() for _ in range(num_stages)]
    received_grad: list[set[int]] = [set() for _ in range(num_stages)]
    forwarded: list[set[int]] = [set() for _ in range(num_stages)]
    backwarded: list[set[int]] = [set() for _ in range(num_stages)]
    peak = [0] * num_stages
    busy = [0.0] * num_stages
    events: list[Event] = []
    barrier: list[float] = []  # when every stage has reached its STEP (set once all have)

    def step(k: int) -> bool:
        """Execute stage k's next action if it can; False when blocked on a receive."""
        a = programs[k][pc[k]]
        t = clock[k]
        if a.op == "RA":
            if (k, a.mb) not in act_arrival:
                return False
            clock[k] = max(t, act_arrival[(k, a.mb)]) + over[k].get("RA", 0.0)
            received_act[k].add(a.mb)
        elif a.op == "RG":
            if (k, a.mb) not in grad_arrival:
                return False
            clock[k] = max(t, grad_arrival[(k, a.mb)]) + over[k].get("RG", 0.0)
            received_grad[k].add(a.mb)
        elif a.op == "F":
            if k > 0 and a.mb not in received_act[k]:
                raise ScheduleError(f"{_name(k, a)} runs before its activation is received (RA{a.mb})")
            clock[k] = t + fwd_s[k]
            busy[k] += fwd_s[k]
            forwarded[k].add(a.mb)
            peak[k] = max(peak[k], len(forwarded[k] - backwarded[k]))
        elif a.op == "B":
            if a.mb not in forwarded[k]:
                raise ScheduleError(f"{_name(k, a)} runs before F{a.mb}")
            if k < last and a.mb not in received_grad[k]:
                raise ScheduleError(f"{_name(k, a)} runs before its gradient is received (RG{a.mb})")
            clock[k] = t + bwd_s[k]
            busy[k] += bwd_s[k]
            backwarded[k].add(a.mb)
        elif a.op == "SA":
            if a.mb not in forwarded[k]:
                raise ScheduleError(f"{_name(k, a)} sends an activation before F{a.mb}")
            clock[k] = t + over[k].get("SA", 0.0)
            start = max(clock[k], fwd_link_free[k])
            fwd_link_free[k] = start + send_s[k]
            act_arrival[(k + 1, a.mb)] = start + send_s[k]
            events.append(Event(k, "SA", a.mb, start, start + send_s[k]))
            return _advance(k)
        elif a.op == "SG":
            if a.mb not in backwarded[k]:
                raise ScheduleError(f"{_name(k, a)} sends a gradient before B{a.mb}")
            clock[k] = t + over[k].get("SG", 0.0)
            start = max(clock[k], bwd_link_free[k])
            bwd_link_free[k] = start + send_s[k - 1]
            grad_arrival[(k - 1, a.mb)] = start + send_s[k - 1]
            events.append(Event(k, "SG", a.mb, start, start + send_s[k - 1]))
            return _advance(k)
        elif a.op == "STEP":
            if not barrier:
                at_step = [pc[j] >= len(programs[j]) or programs[j][pc[j]].op == "STEP" for j in range(num_stages)]
                if not all(at_step):
                    return False
                barrier.append(max(clock))
            clock[k] = max(t, barrier[0]) + sync[k] + over[k].get("STEP", 0.0)
        else:
            raise ScheduleError(f"{_name(k, a)}: unknown action")
        events.append(Event(k, a.op, a.mb, t, clock[k]))
        return _advance(k)

    def _advance(k: int) -> bool:
        pc[k] += 1
        return True

    while True:
        moved = False
        for k in range(num_stages):
            while pc[k] < len(programs[k]) and step(k):
                moved = True
        if all(pc[k] == len(programs[k]) for k in range(num_stages)):
            break
        if not moved:
            stuck = [f"stage {k} waits at {programs[k][pc[k]]}" for k in range(num_stages) if pc[k] < len(programs[k])]
            raise ScheduleError("the programs deadlock: " + "; ".join(stuck))

    step_time = max(clock) if clock else 0.0
    busy_fraction = [b / step_time if step_time > 0 else 0.0 for b in busy]
    bubble = 1.0 - sum(busy_fraction) / num_stages if step_time > 0 else 0.0
    return Timeline(events, step_time, busy_fraction, bubble, peak)


def combine_replicas(timelines: list[Timeline], reduce_s: float = 0.0) -> Timeline:
    """One timeline of data x pipeline replicas, each simulated alone (stages renumbered in replica order).

    Before the optimizer step replicas share nothing, so each one's own simulation holds. STEP is a
    barrier across all of them: the coordinator needs every replica's gradients, sums them
    (``reduce_s``: the transfers and the sum), and only then does any stage step. Each STEP event
    moves to start at the global barrier; what follows it (the stage's sync and optimizer) is unchanged.
    """
    if len(timelines) == 1 and reduce_s == 0.0:
        return timelines[0]
    # A replica's own barrier: when its last stage reached STEP (the latest STEP start).
    own = [max((e.start_s for e in t.events if e.op == "STEP"), default=t.step_time_s) for t in timelines]
    barrier = max(own) + reduce_s
    events: list[Event] = []
    busy_s: list[float] = []
    peak: list[int] = []
    offset = 0
    for t, mine in zip(timelines, own, strict=True):
        n = len(t.busy_fraction)
        for e in t.events:
            end = barrier + (e.end_s - max(e.start_s, mine)) if e.op == "STEP" else e.end_s
            events.append(Event(e.stage + offset, e.op, e.mb, e.start_s, end))
        busy_s += [f * t.step_time_s for f in t.busy_fraction]
        peak += list(t.peak_in_flight)
        offset += n
    step_time = max([e.end_s for e in events] + [barrier])
    busy_fraction = [b / step_time if step_time > 0 else 0.0 for b in busy_s]
    bubble = 1.0 - sum(busy_fraction) / len(busy_fraction) if busy_fraction and step_time > 0 else 0.0
    return Timeline(events, step_time, busy_fraction, bubble, peak)


def simulate_plan(plan: Plan) -> Timeline:
    """Simulate a plan's stored programs with its predicted per-stage times (every replica, then the
    step's barrier with the gradient reduction between them)."""
    try:
        programs = [parse_program(s.program) for s in plan.stages]
    except ValueError as exc:
        raise ScheduleError(f"plan has a malformed program: {exc}") from None
    timelines = []
    for rep in plan.pipelines:
        stages = [plan.stages[k] for k in rep.stages]
        timelines.append(simulate(
            [programs[k] for k in rep.stages],
            [s.fwd_time_s for s in stages],
            [s.bwd_time_s for s in stages],
            [s.send_time_s for s in stages],
            overhead_s=[dict(s.overhead_s) for s in stages],
            sync_s=[s.step_sync_s for s in stages],
        ))
    return combine_replicas(timelines, plan.prediction.reduce_s if len(timelines) > 1 else 0.0)


def replay_run(plan: Plan, timings: list[dict[str, float]]) -> Timeline:
    """The plan's programs run with a finished run's own per-action times instead of the predicted ones.

    ``timings[k]`` is stage k's seconds per op in one step (medians over the steps, as the run
    report computes them). Compute, send and optimizer times are the run's; a receive's decode is
    the plan's (a measured receive includes its wait); the links are the plan's. If this replay
    matches the measured step but the prediction does not, the schedule model holds and the
    compute estimates were off (re-profile); if the replay is off too, the run lost time the
    simulator does not model.
    """
    if len(timings) != len(plan.stages):
        raise ScheduleError(f"the run has timings for {len(timings)} stages but the plan has {len(plan.stages)}")
    timelines = []
    for rep in plan.pipelines:
        m = max(1, rep.num_micro_batches)
        stages = [plan.stages[k] for k in rep.stages]
        times = [timings[k] for k in rep.stages]
        overhead = [{"SA": t.get("SA", 0.0) / m, "SG": t.get("SG", 0.0) / m,
                     "STEP": max(0.0, t.get("STEP", 0.0) - t.get("clip_wait", 0.0)),
                     "RA": sp.overhead_s.get("RA", 0.0), "RG": sp.overhead_s.get("RG", 0.0)}
                    for t, sp in zip(times, stages, strict=True)]
        timelines.append(simulate(
            [parse_program(sp.program) for sp in stages],
            [t.get("F", 0.0) / m for t in times],
            [t.get("B", 0.0) / m for t in times],
            [sp.send_time_s for sp in stages],
            overhead_s=overhead,
            sync_s=[sp.step_sync_s for sp in stages],
        ))
    return combine_replicas(timelines, plan.prediction.reduce_s if len(timelines) > 1 else 0.0)
