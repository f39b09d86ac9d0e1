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

Interleaved programs (hetero.program: actions naming a chunk) run on the same model with virtual
stages: chunk c of device d is virtual stage c x devices + d; compute and messages are per virtual
stage (``fwd_s``, ``bwd_s`` and ``send_s`` have one entry per virtual stage, ``send_s[j]`` for
virtual stage j to j + 1), while a device's clock, overheads and barrier are per device, and the
directed link between two devices is shared by everything that crosses it that way (the activations
of one chunk and the gradients of the next, for instance). A hand-off between two chunks of one
device takes ``send_s`` too (the planner prices it near zero).

Shared CPU cores (``cores``, a CoreShare): CPU stages on one host whose threads together exceed the
host's cores cannot all compute at once; the OS time-slices them. Stage clocks are then no longer
independent, and planner/schedule/simshare.py replays the same programs in one global clock with processor
sharing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetero.errors import PlanError
from hetero.plan import Plan
from hetero.program import Action, Op


class ScheduleError(PlanError):
    """A per-stage program is invalid: deadlock, missing/duplicate work, unmatched send."""


@dataclass(frozen=True)
class Event:
    stage: int
    op: str  # F, B, RA, RG (the wait), SA, SG (on the link: queued start to arrival), STEP
    mb: int
    start_s: float
    end_s: float
    chunk: int = 0  # the device's chunk (interleaved programs)


@dataclass
class Timeline:
    events: list[Event]
    step_time_s: float
    busy_fraction: list[float]  # per stage: compute (F+B) time / step time
    bubble_fraction: float  # 1 - mean busy fraction: idle share of the pipeline's device-time
    # per stage: most micro-batches forwarded, not yet backwarded (interleaved: (micro-batch, chunk) units)
    peak_in_flight: list[int] = field(default_factory=list)

    def stage_events(self, stage: int, ops: tuple[str, ...] = ("F", "B")) -> list[Event]:
        """The events of one stage (by default its compute), in time order."""
        return sorted((e for e in self.events if e.stage == stage and e.op in ops), key=lambda e: e.start_s)


@dataclass(frozen=True)
class CoreShare:
    """Stages whose compute competes for a host's CPU cores (see the module docstring)."""

    group: tuple[int, ...]  # per stage: its host's index in ``cores``, or -1 (competes with nobody)
    need: tuple[int, ...]  # per stage: the cores one of its compute actions holds (its threads)
    cores: tuple[float, ...]  # per group: the cores the host's stages get (a run may have measured fewer)


def core_share(hosts: list[str], need: list[int], cores: dict[str, int],
               usable: dict[str, float] | None = None) -> CoreShare | None:
    """Which of these stages (on ``hosts``, each holding ``need`` cores; 0: not a CPU stage) share too few
    cores: those whose host (``cores``: known core counts) has fewer cores than its stages' threads; they
    share the host's ``usable`` cores where a run measured them, else all its cores."""
    demand: dict[str, int] = {}
    for h, n in zip(hosts, need, strict=True):
        demand[h] = demand.get(h, 0) + n
    short = [h for h in dict.fromkeys(hosts) if cores.get(h, 0) > 0 and demand[h] > cores[h]]
    if not short:
        return None
    group = tuple(short.index(h) if h in short and n > 0 else -1 for h, n in zip(hosts, need, strict=True))
    return CoreShare(group, tuple(min(n, cores[h]) if h in short else n for h, n in zip(hosts, need, strict=True)),
                     tuple(float((usable or {}).get(h) or cores[h]) for h in short))


def _name(k: int, a: Action) -> str:
    return f"stage {k}: {a}"


def chunks_of(programs: list[list[Action]]) -> int:
    """How many chunks each device's program runs (1 but for interleaved programs); ScheduleError unless every
    device runs the same chunks 0..v-1."""
    if not programs:
        raise ScheduleError("no stage programs to simulate")
    held = [sorted({a.chunk for a in prog if a.op != "STEP"}) for prog in programs]
    v = max((c[-1] + 1 for c in held if c), default=1)
    for k, c in enumerate(held):
        if c != list(range(v)):
            raise ScheduleError(f"stage {k} runs chunks {c}, but another runs {v}: every device holds chunks 0..{v - 1}")
    return v


def _virtual(programs: list[list[Action]], v: int) -> list[list[Action]]:
    """The programs of the virtual stages (chunk c of device d is virtual stage c x devices + d)."""
    p = len(programs)
    return [[a for a in programs[j % p] if a.op != "STEP" and a.chunk == j // p] for j in range(p * v)]


def _validate_static(programs: list[list[Action]]) -> int:
    """Structural checks that need no timing; returns the number of micro-batches."""
    v = chunks_of(programs)
    for k, prog in enumerate(programs):
        if not prog or prog[-1].op != "STEP" or sum(a.op == "STEP" for a in prog) != 1:
            raise ScheduleError(f"stage {k}: the program must end with exactly one STEP")
    virtual = _virtual(programs, v)
    p, num_stages = len(programs), len(virtual)

    def name(j: int) -> str:
        return f"stage {j}" if v == 1 else f"stage {j % p} chunk {j // p}"

    mbs0 = sorted(a.mb for a in virtual[0] if a.op == "F")
    m = len(mbs0)
    if m == 0 or mbs0 != list(range(m)):
        raise ScheduleError(f"{name(0)} must run F0..F{max(m - 1, 0)} once each, found forwards {mbs0}")
    expected = list(range(m))
    for k, prog in enumerate(virtual):
        for op in ("F", "B"):
            got = sorted(a.mb for a in prog if a.op == op)
            if got != expected:
                missing = sorted(set(expected) - set(got))
                dup = sorted({mb for mb in got if got.count(mb) > 1})
                extra = sorted(set(got) - set(expected))
                raise ScheduleError(
                    f"{name(k)}: every micro-batch needs exactly one {op}; missing {missing}, "
                    f"duplicated {dup}, unknown {extra}"
                )
        for a in prog:
            if a.op in ("RA", "SG") and k == 0:
                raise ScheduleError(f"{name(k)}: {a}: the first stage has no previous stage")
            if a.op in ("SA", "RG") and k == num_stages - 1:
                raise ScheduleError(f"{name(k)}: {a}: the last stage has no next stage")
            if not 0 <= a.mb < m:
                raise ScheduleError(f"{name(k)}: {a}: micro-batch out of range 0..{m - 1}")
        for op in ("RA", "SA", "RG", "SG"):
            got = [a.mb for a in prog if a.op == op]
            if len(set(got)) != len(got):
                raise ScheduleError(f"{name(k)}: a micro-batch is {op}'d twice")
    # Every send must be matched by the neighbour's receive (and vice versa), so nothing is left
    # queued and no receive waits forever for a tensor nobody sends.
    for k in range(num_stages - 1):
        sa = {a.mb for a in virtual[k] if a.op == "SA"}
        ra = {a.mb for a in virtual[k + 1] if a.op == "RA"}
        if sa != ra:
            raise ScheduleError(
                f"{name(k)} -> {name(k + 1)}: activations sent {sorted(sa)} but received {sorted(ra)}"
            )
        rg = {a.mb for a in virtual[k] if a.op == "RG"}
        sg = {a.mb for a in virtual[k + 1] if a.op == "SG"}
        if rg != sg:
            raise ScheduleError(f"{name(k + 1)} -> {name(k)}: gradients sent {sorted(sg)} but received {sorted(rg)}")
    return m


def _check_times(num_stages: int, fwd_s: list[float], bwd_s: list[float], send_s: list[float],
                 overhead_s: list[dict[str, float]] | None, sync_s: list[float] | None, chunks: int = 1,
                 ) -> tuple[list[dict[str, float]], list[float]]:
    """One time per (virtual) stage (one send per link); the overheads and syncs per device, zero where not given."""
    n = num_stages * chunks
    if not (len(fwd_s) == len(bwd_s) == n and len(send_s) >= n - 1):
        what = f"{num_stages} programs" + (f" of {chunks} chunks" if chunks > 1 else "")
        raise ScheduleError(
            f"{what} need {n} fwd/bwd times and {n - 1} send times, "
            f"got {len(fwd_s)}, {len(bwd_s)}, {len(send_s)}"
        )
    over = list(overhead_s) if overhead_s else [{} for _ in range(num_stages)]
    sync = list(sync_s) if sync_s else [0.0] * num_stages
    if len(over) != num_stages or len(sync) != num_stages:
        raise ScheduleError(f"{num_stages} programs need {num_stages} overhead and sync entries, "
                            f"got {len(over)} and {len(sync)}")
    return over, sync


class _Simulation:
    """The pipeline being simulated: each device's program counter and clock, what each (virtual) stage has
    received, forwarded and backwarded, when each directed link between devices is free, and the events so far."""

    def __init__(self, programs: list[list[Action]], fwd_s: list[float], bwd_s: list[float], send_s: list[float],
                 over: list[dict[str, float]], sync: list[float], chunks: int = 1) -> None:
        num_stages = len(programs)
        self.programs, self.fwd_s, self.bwd_s, self.send_s = programs, fwd_s, bwd_s, send_s
        self.over, self.sync, self.last = over, sync, num_stages * chunks - 1  # the last virtual stage
        self.pc = [0] * num_stages
        self.clock = [0.0] * num_stages
        # Arrival time of tensors at their receiver: act[(j, mb)] arrives at virtual stage j, grad[(j, mb)] too.
        self.act_arrival: dict[tuple[int, int], float] = {}
        self.grad_arrival: dict[tuple[int, int], float] = {}
        self.devices = num_stages
        self.link_free = [0.0] * (num_stages * num_stages)  # [from device x devices + to device]: when it is free
        virtual = num_stages * chunks
        self.received_act: list[set[int]] = [set() for _ in range(virtual)]
        self.received_grad: list[set[int]] = [set() for _ in range(virtual)]
        self.forwarded: list[set[int]] = [set() for _ in range(virtual)]
        self.backwarded: list[set[int]] = [set() for _ in range(virtual)]
        self.in_flight = [0] * num_stages  # per device: (micro-batch, chunk) units forwarded, not yet backwarded
        self.peak = [0] * num_stages
        self.busy = [0.0] * num_stages
        self.events: list[Event] = []
        self.barrier: list[float] = []  # when every stage has reached its STEP (set once all have)

    def run(self) -> None:
        """Advance every stage as far as it can, repeatedly, until all finish; raise on a deadlock."""
        programs, pc = self.programs, self.pc
        while True:
            moved = False
            for k in range(len(programs)):
                while pc[k] < len(programs[k]) and self.step(k):
                    moved = True
            if all(pc[k] == len(programs[k]) for k in range(len(programs))):
                break
            if not moved:
                stuck = [f"stage {k} waits at {programs[k][pc[k]]}" for k in range(len(programs))
                         if pc[k] < len(programs[k])]
                raise ScheduleError("the programs deadlock: " + "; ".join(stuck))

    def step(self, k: int) -> bool:
        """Execute stage k's next action if it can; False when blocked on a receive or the barrier."""
        a = self.programs[k][self.pc[k]]
        t = self.clock[k]
        op = a.op  # identity checks: the simulator runs thousands of times per search
        j = a.chunk * self.devices + k if a.chunk else k  # the virtual stage
        if op is Op.RA:
            if not self._receive(k, j, a, t, self.act_arrival, self.received_act, "RA"):
                return False
        elif op is Op.RG:
            if not self._receive(k, j, a, t, self.grad_arrival, self.received_grad, "RG"):
                return False
        elif op is Op.F:
            self._forward(k, j, a, t)
        elif op is Op.B:
            self._backward(k, j, a, t)
        elif op is Op.SA or op is Op.SG:
            self._send(k, j, a, t)
            self.pc[k] += 1
            return True  # a send's event is its time on the link, recorded by the send
        elif op is Op.STEP:
            if not self._optimizer_step(k, t):
                return False
        else:
            raise ScheduleError(f"{_name(k, a)}: unknown action")
        self.events.append(Event(k, op, a.mb, t, self.clock[k], a.chunk))
        self.pc[k] += 1
        return True

    def _receive(self, k: int, j: int, a: Action, t: float, arrival: dict[tuple[int, int], float],
                 received: list[set[int]], op: str) -> bool:
        """Wait for the tensor, then decode it; False if it has not been sent yet."""
        if (j, a.mb) not in arrival:
            return False
        self.clock[k] = self._overhead(k, max(t, arrival[(j, a.mb)]), op)
        received[j].add(a.mb)
        return True

    def _forward(self, k: int, j: int, a: Action, t: float) -> None:
        """Run a forward: its activation must have been received (but on stage 0)."""
        if j > 0 and a.mb not in self.received_act[j]:
            raise ScheduleError(f"{_name(k, a)} runs before its activation is received (RA{a.mb})")
        self.clock[k] = t + self.fwd_s[j]
        self.busy[k] += self.fwd_s[j]
        self.forwarded[j].add(a.mb)
        self.in_flight[k] += 1
        self.peak[k] = max(self.peak[k], self.in_flight[k])

    def _backward(self, k: int, j: int, a: Action, t: float) -> None:
        """Run a backward: after its forward and (but on the last stage) its received gradient."""
        if a.mb not in self.forwarded[j]:
            raise ScheduleError(f"{_name(k, a)} runs before F{a.mb}")
        if j < self.last and a.mb not in self.received_grad[j]:
            raise ScheduleError(f"{_name(k, a)} runs before its gradient is received (RG{a.mb})")
        self.clock[k] = t + self.bwd_s[j]
        self.busy[k] += self.bwd_s[j]
        self.backwarded[j].add(a.mb)
        self.in_flight[k] -= 1

    def _overhead(self, k: int, t: float, op: str) -> float:
        """When stage k's CPU work for ``op`` (a message's encode or decode, the optimizer) ready at ``t`` ends."""
        return t + self.over[k].get(op, 0.0)

    def _send(self, k: int, j: int, a: Action, t: float) -> None:
        """Encode, then queue on the link to the next (SA) or previous (SG) virtual stage's device, one tensor at a
        time in program order; a link between two devices carries one tensor at a time each way."""
        forward = a.op is Op.SA
        if a.mb not in (self.forwarded[j] if forward else self.backwarded[j]):
            what = "an activation" if forward else "a gradient"
            raise ScheduleError(f"{_name(k, a)} sends {what} before {'F' if forward else 'B'}{a.mb}")
        to = j + 1 if forward else j - 1
        seconds = self.send_s[j if forward else to]
        link = k * self.devices + to % self.devices
        self.clock[k] = self._overhead(k, t, a.op)
        start = max(self.clock[k], self.link_free[link])
        self.link_free[link] = start + seconds
        (self.act_arrival if forward else self.grad_arrival)[(to, a.mb)] = start + seconds
        self.events.append(Event(k, a.op, a.mb, start, start + seconds, a.chunk))

    def _optimizer_step(self, k: int, t: float) -> bool:
        """The barrier (every stage at its STEP), the clip round trip, then the step; False: not all there yet."""
        if not self.barrier:
            programs, pc = self.programs, self.pc
            at_step = [pc[j] >= len(programs[j]) or programs[j][pc[j]].op == "STEP" for j in range(len(programs))]
            if not all(at_step):
                return False
            self.barrier.append(max(self.clock))
        self.clock[k] = self._overhead(k, max(t, self.barrier[0]) + self.sync[k], "STEP")
        return True

    def timeline(self) -> Timeline:
        """The finished run's events, step time and busy and bubble fractions."""
        step_time = max(self.clock) if self.clock else 0.0
        busy_fraction = [b / step_time if step_time > 0 else 0.0 for b in self.busy]
        bubble = 1.0 - sum(busy_fraction) / len(self.programs) if step_time > 0 else 0.0
        return Timeline(self.events, step_time, busy_fraction, bubble, self.peak)


def simulate(
    programs: list[list[Action]], fwd_s: list[float], bwd_s: list[float], send_s: list[float], *,
    overhead_s: list[dict[str, float]] | None = None, sync_s: list[float] | None = None,
    cores: CoreShare | None = None,
) -> Timeline:
    """Run the programs on a model of the pipeline; raise ScheduleError if they are invalid.

    Interleaved programs (actions naming chunks) take one ``fwd_s``/``bwd_s`` per virtual stage and a
    ``send_s`` per virtual hand-off (the module docstring)."""
    chunks = chunks_of(programs)
    over, sync = _check_times(len(programs), fwd_s, bwd_s, send_s, overhead_s, sync_s, chunks)
    _validate_static(programs)
    if cores is not None and not (len(cores.group) == len(cores.need) == len(programs)):
        raise ScheduleError(f"{len(programs)} programs need {len(programs)} core-share entries, got {len(cores.group)}")
    if cores is not None:
        from hetero.planner.schedule.simshare import SharedSimulation

        return SharedSimulation(programs, fwd_s, bwd_s, send_s, over, sync, cores).run()
    run = _Simulation(programs, fwd_s, bwd_s, send_s, over, sync, chunks)
    run.run()
    return run.timeline()


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
            events.append(Event(e.stage + offset, e.op, e.mb, e.start_s, end, e.chunk))
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
        programs = [s.actions() for s in plan.stages]
    except ValueError as exc:
        raise ScheduleError(f"plan has a malformed program: {exc}") from None
    timelines = []
    for rep in plan.pipelines:
        stages = [plan.stages[k] for k in rep.stages]
        fwd, bwd, send = virtual_times(stages)
        timelines.append(simulate(
            [programs[k] for k in rep.stages], fwd, bwd, send,
            overhead_s=[dict(s.overhead_s) for s in stages],
            sync_s=[s.step_sync_s for s in stages],
            cores=plan_core_share(plan, rep.stages),
        ))
    return combine_replicas(timelines, plan.prediction.reduce_s if len(timelines) > 1 else 0.0)


def virtual_times(stages: list[Any]) -> tuple[list[float], list[float], list[float]]:
    """A pipeline's predicted forward, backward and send seconds per micro-batch by virtual stage: its stages' own,
    or under an interleaved schedule chunk c of stage d at c x stages + d (plan StagePlan.chunks)."""
    chunks = [[(s.fwd_time_s, s.bwd_time_s, s.send_time_s)]
              + [(c.fwd_time_s, c.bwd_time_s, c.send_time_s) for c in s.chunks] for s in stages]
    order = [chunks[d][c] for c in range(len(chunks[0])) for d in range(len(stages))]
    return [t[0] for t in order], [t[1] for t in order], [t[2] for t in order]


def _measured(times: list[dict[str, float]], op: str, predicted: list[float], mb: int) -> list[float]:
    """Each virtual stage's share of its device's measured seconds per micro-batch of ``op``, as the plan predicts
    the device's chunks (all of them where a device holds one chunk)."""
    p = len(times)
    v = len(predicted) // p
    return [times[j % p].get(op, 0.0) / mb * (x / s if (s := sum(predicted[j % p::p])) > 0 else 1 / v)
            for j, x in enumerate(predicted)]


def plan_core_share(plan: Plan, stages: list[int], usable: dict[str, float] | None = None) -> CoreShare | None:
    """The CPU cores these stages of a plan (one replica) share, from its fleet's hosts' ``cores`` and
    ``usable_cores`` (``usable``: others instead)."""
    cores = {h.name: h.cores for h in plan.cluster.hosts if h.cores}
    if not cores:
        return None
    if usable is None:
        usable = {h.name: h.usable_cores for h in plan.cluster.hosts if h.usable_cores}
    sps = [plan.stages[k] for k in stages]
    return core_share([s.host for s in sps], [(s.threads or 1) if s.backend == "cpu" else 0 for s in sps], cores,
                      usable)


def replay_run(plan: Plan, timings: list[dict[str, float]], *, decontended: bool = False,
               usable: dict[str, float] | None = None) -> Timeline:
    """The plan's programs run with a finished run's own per-action times instead of the predicted ones.

    ``timings[k]`` is stage k's seconds per op in one step (medians over the steps, as the run
    report computes them). Compute, send and optimizer times are the run's; a receive's decode is
    the plan's (a measured receive includes its wait); the links are the plan's. If this replay
    matches the measured step but the prediction does not, the schedule model holds and the
    compute estimates were off (re-profile); if the replay is off too, the run lost time the
    simulator does not model. ``decontended``: the F and B times are each stage's own (its CPU time on
    a host with too few cores, see runtime/run/run_profile.py), so the replay shares the cores itself;
    else they are wall times that already include the sharing (``usable``: the cores each host's stages get,
    instead of the plan's). A timing's ``RA_own``/``RG_own`` (a receive's own CPU time per step) replace the
    plan's decode costs. An interleaved device's measured F and B are shared among its chunks as the plan
    predicts them, and its per-message costs among all its chunks' messages.
    """
    if len(timings) != len(plan.stages):
        raise ScheduleError(f"the run has timings for {len(timings)} stages but the plan has {len(plan.stages)}")
    timelines = []
    for rep in plan.pipelines:
        stages = [plan.stages[k] for k in rep.stages]
        mb = max(1, rep.num_micro_batches)
        times = [timings[k] for k in rep.stages]
        fwd, bwd, send = virtual_times(stages)
        overhead = []
        for t, sp in zip(times, stages, strict=True):
            ops = [a.op.value for a in sp.actions()]
            n = {op: max(1, ops.count(op)) for op in ("SA", "SG", "RA", "RG")}  # a device's messages of a kind
            overhead.append({"SA": t.get("SA", 0.0) / n["SA"], "SG": t.get("SG", 0.0) / n["SG"],
                             "STEP": max(0.0, t.get("STEP", 0.0) - t.get("clip_wait", 0.0)),
                             "RA": t["RA_own"] / n["RA"] if "RA_own" in t else sp.overhead_s.get("RA", 0.0),
                             "RG": t["RG_own"] / n["RG"] if "RG_own" in t else sp.overhead_s.get("RG", 0.0)})
        timelines.append(simulate(
            [sp.actions() for sp in stages], _measured(times, "F", fwd, mb), _measured(times, "B", bwd, mb), send,
            overhead_s=overhead,
            sync_s=[sp.step_sync_s for sp in stages],
            cores=plan_core_share(plan, rep.stages, usable) if decontended else None,
        ))
    return combine_replicas(timelines, plan.prediction.reduce_s if len(timelines) > 1 else 0.0)
