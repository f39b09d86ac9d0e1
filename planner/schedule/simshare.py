"""The simulator for stages that share too few CPU cores: processor sharing in global time.

planner/schedule/simulator.py advances each stage on its own clock, which is exact while stages share nothing but
links. CPU stages on a host whose cores are fewer than their threads (three one-thread stages on two cores)
do share: the OS time-slices the runnable ones, so while all three compute each runs at 2/3 of its speed,
and the pipeline's critical stage slows too. This module replays the same programs with the same action
semantics (asynchronous sends on FIFO full-duplex links, blocking receives, the STEP barrier with its round
trip) in one global clock, and every CPU action of a sharing stage (compute, a message's encode or decode,
the optimizer) progresses at ``min(1, cores / threads of the host's working stages)`` of its own speed.
Actions only ever slow down, so the step is never below the unshared simulation's (and simbound's bound).
Interleaved programs run as planner/schedule/simulator.py runs them: virtual stage c x devices + d for chunk c of
device d, one directed link per pair of devices, the cores shared per device (its process's threads).
"""

from __future__ import annotations

from hetero.planner.schedule.simulator import CoreShare, Event, ScheduleError, Timeline
from hetero.program import Action

EPS = 1e-12


class SharedSimulation:
    """One step of the programs in global time (see the module docstring)."""

    def __init__(self, programs: list[list[Action]], fwd_s: list[float], bwd_s: list[float], send_s: list[float],
                 over: list[dict[str, float]], sync: list[float], cores: CoreShare) -> None:
        n = self.devices = len(programs)
        self.programs, self.fwd_s, self.bwd_s, self.send_s = programs, fwd_s, bwd_s, send_s
        self.over, self.sync, self.cores = over, sync, cores
        self.t = 0.0
        self.pc = [0] * n
        self.work: list[float | None] = [None] * n  # full-speed seconds left of the CPU action under way
        self.began = [0.0] * n  # when the current action began (a receive: when its wait began)
        self.arrival: dict[tuple[str, int, int], float] = {}  # ("RA"/"RG", virtual stage, mb) -> when it arrives
        self.link_free: dict[tuple[int, int], float] = {}  # (from device, to device) -> when it is free
        self.in_flight: list[set[tuple[int, int]]] = [set() for _ in range(n)]  # (mb, chunk) units per device
        self.peak = [0] * n
        self.busy = [0.0] * n
        self.events: list[Event] = []
        self.barrier: float | None = None

    def run(self) -> Timeline:
        """Advance global time from event to event until every program is done."""
        n = len(self.programs)
        while any(self.pc[k] < len(self.programs[k]) for k in range(n)):
            wakes = self._start_all()
            if all(self.pc[k] >= len(self.programs[k]) for k in range(n)):
                break
            rates = self._rates()
            ends = [self.t + w / rates[k] for k, w in enumerate(self.work) if w is not None]
            upcoming = ends + [w for w in wakes if w > self.t + EPS]
            if not upcoming:
                stuck = [f"stage {k} waits at {self.programs[k][self.pc[k]]}" for k in range(n)
                         if self.pc[k] < len(self.programs[k])]
                raise ScheduleError("the programs deadlock: " + "; ".join(stuck))
            t_next = min(upcoming)
            for k, w in enumerate(self.work):
                if w is not None:
                    left = w - rates[k] * (t_next - self.t)
                    self.work[k] = left if left > EPS * max(1.0, w) else 0.0
            self.t = t_next
            for k, w in enumerate(self.work):
                if w == 0.0:
                    self._finish(k)
        step = max([e.end_s for e in self.events] + [self.t])
        busy = [b / step if step > 0 else 0.0 for b in self.busy]
        return Timeline(self.events, step, busy, 1.0 - sum(busy) / n if step > 0 else 0.0, self.peak)

    def _start_all(self) -> list[float]:
        """Start every action that can start now (finishing those that take no CPU); the times it waits for."""
        wakes: list[float] = []
        moved = True
        while moved:
            moved = False
            wakes = []
            for k in range(len(self.programs)):
                while self.work[k] is None and self.pc[k] < len(self.programs[k]):
                    started, wake = self._start(k)
                    if wake is not None:
                        wakes.append(wake)
                    if not started:
                        break
                    moved = True
                    if self.work[k] == 0.0:
                        self._finish(k)
        return wakes

    def _start(self, k: int) -> tuple[bool, float | None]:
        """Begin stage k's next action now if it can: (started, a later time it waits for, if known)."""
        a = self.programs[k][self.pc[k]]
        j = a.chunk * self.devices + k  # the virtual stage
        if a.op in ("RA", "RG"):
            at = self.arrival.get((a.op, j, a.mb))
            if at is None or at > self.t + EPS:
                return False, at
            return self._begin(k, self.over[k].get(a.op, 0.0), keep_began=True), None
        if a.op == "STEP":
            if self.barrier is None:
                at_step = [self.pc[j] >= len(p) or p[self.pc[j]].op == "STEP" and self.work[j] is None
                           for j, p in enumerate(self.programs)]
                if not all(at_step):
                    return False, None
                self.barrier = self.t
            ready = self.barrier + self.sync[k]
            if ready > self.t + EPS:
                return False, ready
            return self._begin(k, self.over[k].get("STEP", 0.0), keep_began=True), None
        seconds = {"F": self.fwd_s[j], "B": self.bwd_s[j]}.get(a.op, self.over[k].get(a.op, 0.0))
        return self._begin(k, seconds), None

    def _begin(self, k: int, seconds: float, keep_began: bool = False) -> bool:
        if not keep_began or self.began[k] > self.t:
            self.began[k] = self.t
        self.work[k] = max(0.0, seconds)
        return True

    def _rates(self) -> list[float]:
        """Each working stage's speed: its share of its host's cores (1 where it shares none)."""
        demand = [0] * len(self.cores.cores)
        for k, w in enumerate(self.work):
            if w is not None and self.cores.group[k] >= 0:
                demand[self.cores.group[k]] += self.cores.need[k]
        return [min(1.0, self.cores.cores[g] / demand[g]) if (g := self.cores.group[k]) >= 0 and demand[g] else 1.0
                for k in range(len(self.work))]

    def _finish(self, k: int) -> None:
        """Stage k's action ends now: its effects, its event, the next action's wait begins."""
        a = self.programs[k][self.pc[k]]
        self.work[k] = None
        if a.op in ("F", "B"):
            self.busy[k] += self.t - self.began[k]
            (self.in_flight[k].add if a.op == "F" else self.in_flight[k].discard)((a.mb, a.chunk))
            self.peak[k] = max(self.peak[k], len(self.in_flight[k]))
        if a.op in ("SA", "SG"):
            self._send(k, a)
        else:
            self.events.append(Event(k, a.op, a.mb, self.began[k], self.t, a.chunk))
        self.pc[k] += 1
        self.began[k] = self.t

    def _send(self, k: int, a: Action) -> None:
        """Queue the encoded tensor on the link to the next (SA) or previous (SG) virtual stage's device (one tensor
        at a time each way between two devices, in program order) and note its arrival."""
        j = a.chunk * self.devices + k
        to, recv, seconds = (j + 1, "RA", self.send_s[j]) if a.op == "SA" else (j - 1, "RG", self.send_s[j - 1])
        link = (k, to % self.devices)
        start = max(self.t, self.link_free.get(link, 0.0))
        self.link_free[link] = start + seconds
        self.arrival[(recv, to, a.mb)] = start + seconds
        self.events.append(Event(k, a.op, a.mb, start, start + seconds, a.chunk))
