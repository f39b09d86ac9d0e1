"""Data x pipeline replicas: R pipelines on disjoint devices, each with its share of the micro-batches.

A replica is a pipeline (objective.Placement over the fleet's device indices) with its own number of
micro-batches m_r >= 1 per optimizer step; the shares sum to the step's M. The step time is

    step = max_r T_r + reduce_s       (R = 1: step = T_0, no reduction)

where T_r is objective.evaluate's step time of replica r run with m_r micro-batches (its memory and
recomputation too), and reduce_s is the LoRA-gradient reduction at the optimizer step: every stage
of every replica sends its gradients to the coordinator (on the host of replica 0's first stage),
which sums them and sends each stage its sum back, serialized: the sum over every stage k of
grad_bytes(span_k) x CostTable.reduce_s_per_byte[host of k][coordinator's host].

The search is exact. Devices come in classes (CostTable.device_classes: interchangeable devices);
a replica uses a sub-multiset U of them (identical replicas are one multiset: no symmetric copies).
T(U, m), the best pipeline on U's devices with m micro-batches, comes from planner.search.exact.solve_exact
on the restricted table; it may leave devices of U idle, so T falls as U grows and rises with m.
For a threshold tau, a DP over (devices left, micro-batches left, coordinator placed?) packs
replicas with T <= tau into the least total reduction g(tau); the optimum is the least tau + g(tau)
over the values T takes. Only values below the best single pipeline minus two reductions matter.
It is lazy: T(U, m) not yet solved enters at a lower bound (planner/replica/replica_bound.py, raised by
every solve of a superset at a smaller share), so the DP gives a lower
bound on the optimum; the (U, m) its packings use are solved and the sweep repeats until the bound
meets the best plan found. g only falls as tau rises and is flat between a packing's slowest
replica and tau, so one DP per level of g suffices, not one per threshold.

A replica on one host sends every gradient byte from there: its reduction is total grad bytes x
c[host][coordinator] whatever its split. One over several hosts trades T against reduction, so its
placements are enumerated (every device order and split, T and reduction per coordinator, their
Pareto fronts) when they are few (ENUMERATE_ROWS); otherwise its reduction is bounded by its
cheapest host, and the result is proven only where that bound does not decide it.

The search ends by the compile's deadline (planner/search/deadline.py). A fleet of many device classes has
too many multisets to search exactly (MAX_MULTISETS: a 20-card rig of 10 kinds has 3^10): it gets
mirrored replicas (each class's devices dealt round-robin, even shares) as candidates, and the
result says it is not proven, with the lower bound ``M x least work / devices + two reductions``
(every replica's busiest device does at least its share of the work; at least two replicas send
every gradient byte). A cut-off exact search keeps its last sweep's bound instead.

This module holds the search. A plan's step (each replica at its share, the reduction) and the mirrored
replicas are planner/replica/replica_plans.py, the packing DP planner/replica/replica_packing.py, the enumerated fronts
planner/replica/replica_fronts.py, the bounds on T(U, m) and on a multi-host replica's reduction planner/replica/replica_bound.py,
and the hosts tried as the coordinator planner/model/host_symmetry.py.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np

from hetero.planner.model.cost import CostTable, subtable
from hetero.planner.model.host_symmetry import representatives
from hetero.planner.model.objective import Evaluation, Placement
from hetero.planner.model.span_costs import SharedCosts
from hetero.planner.replica.replica_bound import CoordinatorShare, parallel_bound, replica_bounds, work_floor
from hetero.planner.replica.replica_fronts import (
    INF,
    REL_TOL,
    ClassPipeline,
    FrontEnumerator,
    Frontier,
    enumeration_rows,
)
from hetero.planner.replica.replica_packing import ClassMultisets, Entry, Options, Picked, front_entry, pack
from hetero.planner.replica.replica_plans import evaluate_replicas, mirrored
from hetero.planner.search.deadline import SINGLE_SHARE, OutOfTime, check, left
from hetero.planner.search.exact import solve_exact
from hetero.planner.search.solve import solve

# Past this many (device order, split) rows per share, a replica over several hosts is not
# enumerated: its reduction is bounded below by its cheapest host instead.
ENUMERATE_ROWS = 200_000
# Past this many sub-multisets of the fleet's device classes (prod of count + 1) the exact search is not
# attempted (its bookkeeping grows as their square): mirrored replicas are tried instead, unproven.
MAX_MULTISETS = 5_000


@dataclass
class ReplicaSolution:
    """R >= 1 pipeline replicas on disjoint devices, their shares of the step's micro-batches and times."""

    placements: list[Placement]  # fleet device indices; replica 0's first stage hosts the coordinator
    shares: list[int]  # micro-batches per step, per replica (sum: table.num_micro_batches)
    evaluations: list[Evaluation]  # each evaluated with its own share
    reduce_s: float  # the gradient reduction at the optimizer step (0 for one replica)
    step_time_s: float  # max of the replicas' step times + reduce_s
    proven_optimal: bool
    message: str
    single: Evaluation | None = None  # the best single pipeline found (R = 1)
    single_proven: bool = False  # ... and whether it is proven optimal among single pipelines
    # A lower bound on every plan of R >= 2 replicas (inf: none fits or none can beat the incumbent),
    # when the search was cut off; None when it finished (proven) or never started.
    replicas_lower_s: float | None = None
    how: str = ""  # what the search did (solves, thresholds, seconds)
    unproven: list[str] = field(default_factory=list)  # why it is not proven

    @property
    def num_replicas(self) -> int:
        return len(self.placements)

    def speedup_over_single(self) -> float | None:
        """Throughput relative to the best single pipeline (None when no single pipeline fits)."""
        if self.single is None:
            return None
        return self.single.step_time_s / self.step_time_s


class _Search:
    """Replicas as multisets of device classes: bounds and solves of T(U, m), enumerated multi-host
    replicas, the packing DP's options and the search over thresholds (see the module docstring)."""

    def __init__(self, table: CostTable, deadline: float, max_replicas: int | None, num_stages: int | None = None,
                 exact_count: bool = False) -> None:
        self.table, self.deadline, self.max_replicas = table, deadline, max_replicas
        # planner.num_stages: every replica has that many stages; exact_count: exactly max_replicas replicas.
        self.num_stages, self.exact_count = num_stages, exact_count
        self.n, self.total_mb = table.num_nodes, table.num_micro_batches
        self.sets = sets = ClassMultisets.of(table, deadline)
        self.grad_total = sum(table.grad_bytes)
        cost, hosts = table.reduce_s_per_byte, sorted(set(sets.host))
        # One cost everywhere: the coordinator's host does not matter (one candidate, any replica leads).
        self.flat = self.grad_total == 0 or len({cost[a][b] for a in hosts for b in hosts}) == 1
        # Interchangeable hosts (planner/model/host_symmetry.py): any plan has a twin, as fast, summed on the first of them.
        self.coordinators = hosts[:1] if self.flat else representatives(table, hosts)
        self.two = 2.0 * self.grad_total * min(cost[a][b] for a in hosts for b in self.coordinators)
        # "one": the reduction does not depend on the placement; "enum": enumerated; "bound": bounded.
        self.kind = ["one" if self.flat or len(h) <= 1
                     else "enum" if enumeration_rows(sets.multisets[u], self.n) <= ENUMERATE_ROWS else "bound"
                     for u, h in enumerate(sets.hosts_of)]
        self.share = CoordinatorShare(table, sets)  # a replica over several hosts: its reduction, bounded
        self.stage_store: dict = {}  # stage cost arrays per (class, held), shared by the solves (SharedCosts)
        self.enumerator = FrontEnumerator(table, sets.members, self.coordinators, num_stages, deadline,
                                          SharedCosts(sets.classes, self.stage_store))
        self.solved: dict[tuple[int, int], ClassPipeline | None] = {}  # None: nothing fits under tau_max
        self.frontiers: dict[tuple[int, int], Frontier] = {}
        self.solves = self.enumerations = self.thresholds = 0
        self.solved_times: list[float] = []  # every solved pipeline's T, ascending
        # Per (threshold, coordinator): the packing of solved pipelines only, and what it was computed from.
        self.achieved: dict[tuple[float, int], tuple[tuple[int, int], tuple[float, float, Picked]]] = {}
        self.unproven: list[str] = []
        self.best: float = INF  # the best R >= 2 packing found (or the bar it must beat)
        self.picked: Picked = []
        self.lower: float = parallel_bound(table)  # on every R >= 2 plan; each finished sweep raises it
        self.floor = work_floor(table)  # every R >= 2 plan's slowest replica takes at least this
        self._bounds()

    def _bounds(self) -> None:
        """lb[u][m] <= T(U, m) and period[u] <= the period of any pipeline on U (planner/replica/replica_bound.py)."""
        self.lb, self.period = replica_bounds(self.table, self.sets, self.deadline)

    def record(self, u: int, m: int, pipe: ClassPipeline | None) -> None:
        """A solve's answer, and what it implies for every V <= U at shares >= m: T(V, m') >= T(U, m) +
        (m' - m) P(V) (the same placement at m costs no more), and past tau_max where U is."""
        self.solved[(u, m)] = pipe
        if pipe is not None:
            bisect.insort(self.solved_times, pipe.time_s)
        subs = self.sets.subsets[u]
        if pipe is None:
            self.lb[np.ix_(subs, range(m, self.total_mb + 1))] = INF
            return
        grow = np.arange(self.total_mb + 1 - m)[None, :] * self.period[subs][:, None]
        block = self.lb[subs, m:]
        self.lb[subs, m:] = np.maximum(block, pipe.time_s + grow)

    def value(self, u: int, m: int) -> float:
        """T(U, m) where known (solved or enumerated), else its lower bound; inf: past tau_max or none fits."""
        if (u, m) in self.solved:
            pipe = self.solved[(u, m)]
            return INF if pipe is None else pipe.time_s
        return float(self.lb[u, m])

    def reductions(self, classes: tuple[int, ...], spans: tuple[tuple[int, int], ...]) -> tuple[float, ...]:
        """A pipeline's gradient reduction, per coordinator candidate."""
        cost, grad, host = self.table.reduce_s_per_byte, self.table.grad_bytes, self.sets.host
        return tuple(sum(sum(grad[a:b + 1]) * cost[host[c]][h] for c, (a, b) in zip(classes, spans, strict=True))
                     for h in self.coordinators)

    # --- T(U, m): solved or enumerated -------------------------------------------------------------------
    def solve_one(self, u: int, m: int) -> None:
        """The best pipeline on U's devices with m micro-batches, if its T can matter (solve_exact)."""
        tau_max = self.best - self.two
        devices = [d for k, x in enumerate(self.sets.multisets[u]) for d in self.sets.members[k][:x]]
        upper = tau_max * (1 + REL_TOL) if tau_max < INF else None
        shared = SharedCosts([self.sets.classes[d] for d in devices], self.stage_store)
        result = solve_exact(subtable(self.table, m, devices), self.num_stages, deadline=self.deadline, upper_s=upper,
                             shared=shared)
        self.solves += 1
        if not result.proven:
            check(self.deadline)
            self.unproven.append(f"a replica's pipeline solve was not proven ({result.reason})")
        if result.placement is None or result.value_s is None:
            self.record(u, m, None)
            return
        p = result.placement
        classes = tuple(self.sets.classes[devices[i]] for i in p.devices)
        self.record(u, m, ClassPipeline(result.value_s, classes, p.spans, self.reductions(classes, p.spans)))

    def enumerate_pair(self, u: int, m: int) -> None:
        """Enumerate a multi-host replica at share m; its least T bounds smaller replicas as a solve does."""
        front = self.enumerator.enumerate(self.sets.multisets[u], m, self.best - self.two)
        self.enumerations += 1
        if front is None:
            self.record(u, m, None)
            return
        self.frontiers[(u, m)] = front
        self.record(u, m, ClassPipeline(front.least_s, (), (), ()))

    # --- packing -----------------------------------------------------------------------------------------
    def options(self, tau: float, hi: int, lower: bool, cap: float | None = None) -> Options:
        """Every replica with T <= tau at some share. ``lower``: T where solved, else its bound, and a
        bounded replica's reduction at its bound for any of its pipelines with T below ``cap`` (default tau; a
        relaxation); else solved pipelines only (achievable: a share may run a pipeline solved for a larger
        one, no slower)."""
        out = {}
        for u in range(1, self.sets.full):
            entries = (self._lower_entries(u, tau, hi, tau if cap is None else cap) if lower
                       else self._solved_entries(u, tau, hi))
            if entries:
                out[u] = (self.kind[u] == "one", entries)
        return out

    def _lower_entries(self, u: int, tau: float, hi: int, cap: float) -> list[Entry]:
        """U's options at every share whose T (or its bound) is <= tau, reductions at their bound (a replica over
        several hosts: CoordinatorShare's for its pipelines with T up to ``cap``, at the share)."""
        h, kind, hosts = self.coordinators[hi], self.kind[u], self.sets.hosts_of[u]
        leads = self.flat or h in hosts
        entries: list[Entry] = []
        for m in range(1, self.total_mb):
            if (t := self.value(u, m)) > tau:
                break
            if (u, m) in self.frontiers:
                entries.append(front_entry(self.frontiers[(u, m)], m, tau, hi))
                continue
            red = (self.grad_total * self.table.reduce_s_per_byte[min(hosts)][h] if kind == "one"
                   else self.share.reduction(u, h, cap, m))
            pipe = None if kind == "enum" else self.solved.get((u, m))
            entries.append((m, red, red if leads else INF, pipe, pipe, t, t))
        return entries

    def _solved_entries(self, u: int, tau: float, hi: int) -> list[Entry]:
        """U's options from solved pipelines with T <= tau (a share may run one solved for a larger share)."""
        h, entries = self.coordinators[hi], []
        pipe, front = None, None
        for m in range(self.total_mb - 1, 0, -1):
            found = self.solved.get((u, m))
            if found is not None and found.time_s <= tau:
                pipe, front = found, self.frontiers.get((u, m))
            if front is not None:
                entries.append(front_entry(front, m, tau, hi))
            elif pipe is not None:
                red = pipe.reduce_s[hi]
                leads = self.flat or self.sets.host[pipe.classes[0]] == h
                entries.append((m, red, red if leads else INF, pipe, pipe, pipe.time_s, pipe.time_s))
        entries.reverse()
        return entries

    def pack(self, opts: Options, relaxed: bool = False) -> tuple[float, float, Picked]:
        """The least total reduction of disjoint replicas whose shares sum to M, one of them the
        coordinator's (``relaxed``: not required, a lower bound as fast again: every entry's reduction is already
        summed on the coordinator's host): (reduction, the largest T among them, the replicas); inf, inf, []
        when none do."""
        return pack(self.sets, opts, self.total_mb, not self.flat and not relaxed, self.max_replicas,
                    self.exact_count, self.deadline)

    def pack_solved(self, tau: float, hi: int) -> tuple[float, float, Picked]:
        """``pack`` over the solved pipelines with T <= tau only (achievable), again only when a solve or an
        enumeration since the last time could change it."""
        seen = (bisect.bisect_right(self.solved_times, tau), len(self.frontiers))
        kept = self.achieved.get((tau, hi))
        if kept is None or kept[0] != seen:
            kept = self.achieved[(tau, hi)] = (seen, self.pack(self.options(tau, hi, lower=False)))
        return kept[1]

    def exact(self, picked: Picked) -> bool:
        """Every replica of a relaxed packing is a solved pipeline at its true reduction, and the coordinator's
        replica is among them where it matters."""
        return ((self.flat or any(lead for *_, lead in picked))
                and all(pipe is not None and self.kind[u] != "bound" for u, _, pipe, _ in picked))

    def sweep(self) -> tuple[float, list[tuple[int, int]]]:
        """One pass down the thresholds: (a lower bound on every plan of R >= 2 replicas, capped at the
        incumbent where nothing beats it; the unsolved replicas of every relaxed packing below the incumbent).
        At tau a coordinator's relaxed DP has its least reduction r, reached by a packing whose largest T is t.
        It stands for every plan whose slowest replica takes T below ``cap``, the bottom of what the thresholds
        above covered (no replica's T bound lies between tau and cap), so its bounded replicas' reductions are bounded
        for pipelines as slow as ``cap``, not tau: a slower pipeline can put more layers on the coordinator's host.
        Every such plan with T at least t costs at least T + r, and every one with T at least best - r loses to
        the incumbent. So the next threshold is the largest below min(t, best - r) (or below t, where t + r beats
        the incumbent and its replicas need solving): one DP per distinct reduction, not per threshold, and none
        once no plan's slowest replica can be that fast (``floor``)."""
        limit = (self.best - self.two) * (1 + REL_TOL)
        taus = sorted({v for u in range(1, self.sets.full) for m in range(1, self.total_mb)
                       if (v := self.value(u, m)) <= limit and v < INF}
                      | {float(t) for f in self.frontiers.values() for times, _, _ in f.fronts.values()
                         for t in times if t <= limit})
        low, todo, active, cap = INF, [], list(range(len(self.coordinators))), limit
        i = len(taus) - 1
        while i >= 0 and active:
            check(self.deadline)
            self.thresholds += 1
            tau, reach = taus[i], -INF
            for hi in list(active):
                opts = self.options(tau, hi, lower=True, cap=cap)
                red, slowest, pick = self.pack(opts, relaxed=True)
                if (not self.flat and slowest + red < self.best * (1 - REL_TOL)
                        and all(pipe is not None for _, _, pipe, _ in pick)):
                    red, slowest, pick = self.pack(opts)  # nothing to solve: ask for the coordinator's replica too
                if red == INF:
                    active.remove(hi)  # nothing packs at tau, nor below
                    continue
                if slowest + red < self.best * (1 - REL_TOL):
                    down = slowest
                    todo += [(u, m) for u, m, pipe, _ in pick if pipe is None]
                else:
                    down = min(slowest, self.best - red)
                low = min(low, max(down, self.floor) + red)
                if down <= self.floor:
                    active.remove(hi)
                else:
                    reach = max(reach, down)  # hi's least reduction holds on [down, cap)
                if not self.exact(pick):
                    red, slowest, pick = self.pack_solved(tau, hi)
                if pick and slowest + red < self.best:
                    self.best, self.picked = slowest + red, pick
            i, cap = bisect.bisect_left(taus, reach) - 1, reach
        return low, list(dict.fromkeys(todo))

    def run(self, upper: float) -> bool:
        """Lazily: sweep the thresholds with T bounded where not solved; solve what the relaxed packings
        below the incumbent use; again, until none is. True: proven (else a bounded reduction decided)."""
        self.best = upper
        while True:
            low, todo = self.sweep()
            self.lower = max(self.lower, min(low, self.best))
            if low >= self.best * (1 - REL_TOL):
                return True
            if not todo:
                self.unproven.append("a replica over several hosts had its reduction only bounded")
                return False
            # Larger replicas and smaller shares first: what they rule out is not solved again.
            for u, m in sorted(todo, key=lambda x: (-self.sets.size[x[0]], x[1])):
                if (u, m) in self.solved or self.value(u, m) > (self.best - self.two) * (1 + REL_TOL):
                    continue
                if self.kind[u] == "enum":
                    self.enumerate_pair(u, m)
                else:
                    self.solve_one(u, m)

    def assign(self, picked: Picked) -> tuple[list[Placement], list[int]]:
        """Concrete disjoint devices for the replicas, the coordinator's first."""
        pools = [iter(mem) for mem in self.sets.members]
        order = sorted(picked, key=lambda x: not x[3])
        placements = [Placement(tuple(next(pools[c]) for c in pipe.classes), pipe.spans)
                      for _, _, pipe, _ in order if pipe is not None]
        return placements, [m for _, m, _, _ in order]


def _single_solution(table: CostTable, single: Evaluation | None, proven: bool, message: str,
                     found: _Found | None = None) -> ReplicaSolution | None:
    if single is None:
        return None
    return ReplicaSolution([single.placement], [table.num_micro_batches], [single], 0.0, single.step_time_s,
                           proven, message, single, proven, None if proven or found is None else found.lower_s,
                           found.how if found else "", found.unproven if found else [])


@dataclass
class _Found:
    """What the R >= 2 search found: its best replicas (none: nothing beats the bar) and how sure it is."""

    proven: bool
    placements: list[Placement]
    shares: list[int]
    lower_s: float  # a lower bound on every plan of R >= 2 replicas
    unproven: list[str]  # why not proven
    how: str  # what it did


def _search(table: CostTable, upper: float, limit: int, forced: bool, num_stages: int | None,
            deadline: float) -> _Found:
    """The R >= 2 search by ``deadline``: exact over class multisets where they are few (MAX_MULTISETS),
    mirrored replicas where not."""
    t0 = time.perf_counter()
    if (count := ClassMultisets.count(table)) > MAX_MULTISETS:
        found = mirrored(table, limit, num_stages, deadline, forced)
        why = (f"the fleet's {max(table.device_classes()) + 1} device classes make {count:,} replica multisets "
               f"(the exact replica search stops at {MAX_MULTISETS:,}): only mirrored replicas were tried")
        placements, shares = found if found is not None else ([], [])
        if placements and evaluate_replicas(table, placements, shares)[2] >= upper:
            placements, shares = [], []
        return _Found(False, placements, shares, parallel_bound(table), [why], f"{time.perf_counter() - t0:.2f} s")
    search: _Search | None = None
    try:
        search = _Search(table, deadline, limit if forced or limit < min(table.num_micro_batches, table.num_devices)
                         else None, num_stages, exact_count=forced)
        proven = search.run(upper)
    except OutOfTime:
        proven = False
    if search is None:
        return _Found(False, [], [], parallel_bound(table), ["out of time before the search could start"], "")
    if not proven and not search.unproven:
        search.unproven.insert(0, "out of time")
    how = (f"{search.solves} replica solves, {search.enumerations} enumerations, {search.thresholds} thresholds, "
           f"{time.perf_counter() - t0:.2f} s")
    if not search.picked or search.best >= upper:
        return _Found(proven, [], [], search.lower, search.unproven, how)
    placements, shares = search.assign(search.picked)
    return _Found(proven, placements, shares, search.lower, search.unproven, how)


def solve_replicas(table: CostTable, time_limit_s: float = 30.0, max_replicas: int | None = None,
                   starts: list[Placement] | None = None, num_replicas: int | None = None,
                   num_stages: int | None = None, deadline: float | None = None,
                   single: tuple[Evaluation | None, bool] | None = None) -> ReplicaSolution | None:
    """The fastest plan of R >= 1 pipeline replicas under the module's step-time model (None: none fits).

    ``num_replicas``: exactly that many replicas (planner.replicas; the single pipeline is still solved,
    for comparison); ``num_stages``: every replica has that many stages (planner.num_stages). Everything
    ends by ``deadline`` (time.perf_counter(); default now + ``time_limit_s``). ``single``: the best single
    pipeline already found and whether it is proven (else it is solved here, in SINGLE_SHARE of the time)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s if deadline is None else deadline
    if single is None:
        result = solve(table, num_stages, max(0.05, SINGLE_SHARE * left(deadline)), starts=starts)
        single = (result.evaluation, result.report.proven_optimal
                  or (result.evaluation is None and result.report.status == "Infeasible"))
    best_single, single_proven = single
    if num_replicas is not None and num_replicas > min(table.num_micro_batches, table.num_devices):
        return None
    limit = num_replicas or min(table.num_micro_batches, table.num_devices, max_replicas or table.num_devices)
    if limit <= 1:
        return _single_solution(table, best_single, single_proven, "one pipeline (one replica allowed)")
    forced = num_replicas is not None
    upper = best_single.step_time_s if best_single is not None and not forced else INF
    found = _search(table, upper, limit, forced, num_stages, deadline)
    proven = found.proven and single_proven
    if not single_proven:
        found.unproven.append("the single pipeline is not proven optimal")
    lower = None if proven else found.lower_s
    why = "" if proven else f"; not proven optimal: {'; '.join(found.unproven)}"
    if forced and not found.placements:
        return None
    if not found.placements:
        return _single_solution(table, best_single, proven, f"one pipeline: no replicas are faster ({found.how}){why}",
                                found)
    evaluations, reduce_s, step = evaluate_replicas(table, found.placements, found.shares)
    if not all(e.feasible for e in evaluations) or step >= upper:
        # The replicas do not check out under objective.evaluate (a bug) or lose: keep the single pipeline.
        bad = (f"the best replicas found evaluate at {step:.6g} s/step" if all(e.feasible for e in evaluations)
               else "the best replicas found do not fit together (their hosts' RAM or memory)")
        found.unproven.append(bad)
        return _single_solution(table, best_single, False, f"one pipeline ({bad}){why}", found)
    placements = [Placement(p.devices, p.spans, tuple(e.recompute), tuple(e.stream))
                  for p, e in zip(found.placements, evaluations, strict=True)]
    gain = (f": {best_single.step_time_s / step:.2f}x the throughput of the best single pipeline "
            f"({best_single.step_time_s:.4g} s/step)" if best_single is not None else " (no single pipeline fits)")
    message = (f"{len(placements)} replicas, shares {'+'.join(map(str, found.shares))}, {step:.4g} s/step "
               f"({reduce_s:.3g} s of it the gradient reduction){gain}; {found.how}{why}")
    return ReplicaSolution(placements, found.shares, evaluations, reduce_s, step, proven, message, best_single,
                           single_proven, lower, found.how, found.unproven)
