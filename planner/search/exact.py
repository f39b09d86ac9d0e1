"""The exact placement solver: a threshold DP over device classes, for fleets of a few card kinds.

The 1F1B step time (objective.pipeline_step_time) is ``sum_k t_k + 2 sum_k c_k + (m-1) P`` with
``t_k = f_k + b_k`` and the period ``P = max(max_k t_k, max_k 2 c_k)``. For a fixed threshold P a
DP finds S(P), the smallest sum among placements whose every stage and link term is <= P; the
optimum is the smallest S(P) + (m-1) P over the candidate thresholds (every stage and link term).
S only falls as P rises, so a branch and bound over intervals of candidates needs few DPs: an
interval is dropped when S at a larger threshold plus (m-1) times its smallest threshold cannot
beat the best placement found, and a DP at P whose placement has period q settles every threshold
in [q, P] at once. GPipe (``sum + (m-1)(P_f + P_b)``) is the same search over boxes of (P_f, P_b).

The DP builds the pipeline from its last stage backward over states (first node covered,
multiset of device classes used, class of the stage starting there). The multiset's size is the
number of stages after the next one, which fixes that stage's micro-batches in flight under 1F1B
(its memory), and its counts use each device at most once; the class of the stage after a cut
prices the link. Classes are interchangeable devices (CostTable.device_classes), so a rig of 16
cards of 2-4 kinds has at most a few hundred multisets, and the DP is vectorised over them. Per
stage the fewest recomputing layers that fit is also the fastest (objective.stage_recompute): no
state for it. Weight streaming likewise: per stage and micro-batches in flight, the (recompute, stream) pair
of least added time that fits (objective.stage_choice) is the best, because the 1F1B step only grows with
each stage's f + b. Under GPipe, whose step adds the largest f and the largest b separately, that rule is
the planner's choice (a pair with more forward but less total time could shorten the forward period):
exact for 1F1B and for GPipe without streaming (recomputing adds to backward only). Host RAM couples the
stages of a host; the DP does not see it (planner/streaming.py: ram_may_bind). Stage sums are formed in
objective.evaluate's order, so memory tests agree bit for bit.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Placement, hop_messages_s
from hetero.planner.model.span_costs import SharedCosts, stage_costs
from hetero.planner.schedule.step_form import linear_step
from hetero.planner.search.deadline import OutOfTime, check

# Past this many DP states ((nodes + 1) x multisets x classes) the DP is not attempted: the ILP runs.
MAX_STATES = 6_000_000
# Thresholds whose lower bound is within this fraction of the best placement are not searched
# (float noise: the step time itself is a sum of hundreds of rounded terms).
REL_TOL = 1e-12


@dataclass
class ExactResult:
    """What the exact search found and how sure it is."""

    placement: Placement | None  # the best placement found (None: none fits, or none found in time)
    value_s: float | None  # its step time, by the DP's arithmetic
    proven: bool  # the search finished: nothing beats value_s (or, with placement None, nothing fits)
    lower_bound_s: float | None  # on the optimum (= value_s when proven)
    dp_runs: int = 0
    reason: str = ""  # why it was not attempted or did not finish


@dataclass
class _Path:
    stages: list[tuple[int, int, int, int, int]]  # (class, first, last, recompute, stream)
    total_s: float  # sum_k (f_k + b_k) + 2 sum_k c_k
    periods: tuple[float, ...]  # one per period group of the step form (1F1B: (P,); GPipe: (P_f, P_b))


@dataclass
class _Box:
    lower: float
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    sum_bound: float = field(compare=False)

    def __lt__(self, other: _Box) -> bool:
        return self.lower < other.lower


class ThresholdDP:
    """The DP of one table (see the module docstring); ``run`` solves it for one threshold."""

    def __init__(self, table: CostTable, num_stages: int | None, deadline: float | None = None,
                 bound: bool = False, shared: SharedCosts | None = None) -> None:
        self.table, self.deadline, self.bound, self.shared = table, deadline, bound, shared
        n, m = table.num_nodes, table.num_micro_batches
        self.n, self.m = n, m
        self.form = table.form
        classes = table.device_classes()
        self.num_classes = nc = max(classes) + 1
        self.members = [[d for d, c in enumerate(classes) if c == k] for k in range(nc)]
        self.most_stages = num_stages or min(n, table.num_devices)
        self.num_stages = num_stages
        avail = [min(len(mem), self.most_stages) for mem in self.members]
        self.avail = avail
        self.num_multisets = math.prod(a + 1 for a in avail)
        self.states = (n + 1) * self.num_multisets * nc  # ~10 bytes each while it runs

    def too_big(self) -> bool:
        """True when the state space is past MAX_STATES (too many device classes for the DP)."""
        return self.states > MAX_STATES

    def prepare(self) -> None:
        """Stage and link cost arrays and the multiset bookkeeping (raises OutOfTime past the deadline)."""
        table, n, m, nc, avail = self.table, self.n, self.m, self.num_classes, self.avail
        self.helds = self.form.helds(m, self.most_stages)
        fwd, bwd, rec, stream = [], [], [], []
        for mem in self.members:
            check(self.deadline)
            f, b, r, s = stage_costs(table, mem[0], self.helds, self.shared)
            fwd.append(f)
            bwd.append(b)
            rec.append(r)
            stream.append(s)
        self.fwd, self.bwd, self.rec, self.stream = np.array(fwd), np.array(bwd), np.array(rec), np.array(stream)
        self.time = self.fwd + self.bwd  # f + b, inf where the stage does not fit
        # Per max term of the objective (the step form's closed form, or its lower bound): stage and link weights.
        held = np.array(self.helds, dtype=float)
        groups = self.form.bound if self.bound else self.form.groups
        self.terms = [np.broadcast_to(g.stage(self.fwd, self.bwd, held, m) if self.bound else g.stage(self.fwd, self.bwd),
                                      self.time.shape) for g in groups]
        self.link_weights = [g.link for g in groups]
        reps = [mem[0] for mem in self.members]
        self.link = np.array([[[table.transfer_s(e, a, b) for b in reps] for a in reps] for e in range(n)])
        # What a hop adds to the sum: its link both ways, and (for the bound, which must count all the simulator
        # does) the four messages' CPU time: the sender's SA and RG, the receiver's RA and SG (objective.stage_overheads).
        self.hop = 2.0 * self.link + (np.array([[[hop_messages_s(table, e, a, b) for b in reps] for a in reps] for e in range(n)])
                                      if self.bound else 0.0)
        # Multisets as mixed-radix indices: count of class c is (index // stride[c]) % (avail[c] + 1).
        num = self.num_multisets
        self.stride = np.cumprod([1] + [a + 1 for a in avail[:-1]]).astype(np.int64)
        idx = np.arange(num)
        counts = np.stack([(idx // self.stride[c]) % (avail[c] + 1) for c in range(nc)], axis=1)
        self.size = counts.sum(axis=1)
        # The stage added in front of multiset M has |M| stages after it (1F1B: min(|M| + 1, m) in flight).
        most = self.most_stages
        slots = np.array([self.form.slot(p, m, most) for p in range(most)], dtype=np.int64)
        self.held_index = slots[np.minimum(self.size, most - 1)]
        # The bound's round trips (StepForm.suffix): a stage added in front of multiset M holds helds[held_index[M]].
        self.held_of = np.array(self.helds, dtype=float)[self.held_index]
        addable = np.stack([(counts[:, c] < avail[c]) & (self.size < self.most_stages) for c in range(nc)])
        self.addable = addable  # [class][multiset]: one more stage of this class is allowed
        # A lower bound on the time of nodes 0..i-1 wherever they run (for pruning against a cutoff).
        reps = [mem[0] for mem in self.members]
        fastest = [min(table.fwd_s[i][d] + table.bwd_s[i][d] for d in reps) for i in range(n)]
        self.before_lb = np.concatenate([[0.0], np.cumsum(np.nan_to_num(fastest, nan=0.0))]) * (1 - 1e-9)

    def candidates(self) -> list[np.ndarray]:
        """Sorted distinct values each period can take: stage terms and link terms."""
        links = self.link[:-1][np.isfinite(self.link[:-1])] if self.n > 1 else np.zeros(0)
        ok = np.isfinite(self.time)
        return [np.unique(np.concatenate([term[ok], w * links])) for term, w in zip(self.terms, self.link_weights, strict=True)]

    def run(self, limits: tuple[float, ...], cutoff: float = np.inf) -> _Path | None:
        """The placement with the smallest sum whose every period term is <= ``limits``; None if none.

        With a ``cutoff``, partial pipelines that cannot finish below it are dropped: the result is
        exact if its sum is below the cutoff, and otherwise only says that nothing is."""
        n, nc, num = self.n, self.num_classes, self.num_multisets
        ok, link_ok = np.isfinite(self.time), np.ones(self.link.shape, dtype=bool)
        for term, w, limit in zip(self.terms, self.link_weights, limits, strict=True):
            ok &= term <= limit
            link_ok &= w * self.link <= limit
        time = np.where(ok, self.time, np.inf)
        link = np.where(link_ok, self.hop, np.inf)
        # value[j][c][M]: the smallest sum of stages covering nodes j.. with classes M, the first of
        # class c. Adding class c moves M to M + stride[c]: a shifted slice, masked where not allowed
        # (the padding past num absorbs the masked moves; states are ~90% of the solver's memory).
        value = np.full((n + 1, nc, num + int(self.stride.max())), np.inf)
        for c in range(nc):
            if self.avail[c] > 0:
                value[:n, c, self.stride[c]] = time[c, :, n - 1, 0]
        for i in range(n - 1, 0, -1):
            check(self.deadline)
            after = value[i, :, :num]
            if cutoff < np.inf:
                after = np.where(after + self.before_lb[i] < cutoff, after, np.inf)
            if not np.isfinite(after).any():
                continue
            # best[c][M]: the cheapest continuation after a stage of class c ending at node i-1.
            best = (after[None, :, :] + link[i - 1][:, :, None]).min(axis=1)
            best = np.where(self.addable, best, np.inf)
            stage = time[:, :i, i - 1, :]
            reach = np.asarray(np.isfinite(stage).any(axis=2))  # (the bound's weights fall as a stage holds more)
            for c in range(nc):
                if not reach[c].any():
                    continue
                j0 = int(reach[c].argmax())
                cand = stage[c, j0:, :][:, self.held_index] + best[c][None, :]
                if self.bound and self.m > 1:  # a stage whose round trips pass (m - 1) x the threshold is out
                    f, b = (x[c, j0:i, i - 1, :][:, self.held_index] for x in (self.fwd, self.bwd))
                    with np.errstate(invalid="ignore"):
                        over = self.form.suffix(cand, f, b, self.held_of[None, :], self.m) > (self.m - 1) * limits[0]
                    cand = np.where(over, np.inf, cand)
                shift = int(self.stride[c])
                view = value[j0:i, c, shift:shift + num]
                np.minimum(view, cand, out=view)
        final = value[0, :, :num].copy()
        if self.num_stages:
            final[:, self.size != self.num_stages] = np.inf
        flat = int(final.argmin())
        if not np.isfinite(final.flat[flat]) or final.flat[flat] >= cutoff:
            return None
        c, multiset = divmod(flat, num)
        return self._path(value, time, link, 0, c, multiset)

    def _path(self, value: np.ndarray, time: np.ndarray, link: np.ndarray, j: int, c: int,
              multiset: int) -> _Path:
        """Walk the DP's values forward from state (j, c, multiset), redoing its sums bit for bit."""
        n = self.n
        total = float(value[j, c, multiset])
        stages: list[tuple[int, int, int, int, int]] = []
        stage_terms: list[list[float]] = []
        link_terms: list[float] = []
        while True:
            target = value[j, c, multiset]
            rest = multiset - int(self.stride[c])
            h = int(self.held_index[rest])
            if rest == 0:
                nxt, c_next = n, -1
            else:
                # cand[i][c']: the stage j..i-1 then the link and the best state (i, c', rest).
                ends = np.arange(j + 1, n)
                cand = time[c, j, ends - 1, h][:, None] + (value[ends, :, rest] + link[ends - 1, c, :])
                hits = np.argwhere(cand == target)
                pick = hits[0] if len(hits) else np.unravel_index(np.abs(cand - target).argmin(), cand.shape)
                nxt, c_next = int(ends[pick[0]]), int(pick[1])
            stages.append((c, j, nxt - 1, int(self.rec[c, j, nxt - 1, h]), int(self.stream[c, j, nxt - 1, h])))
            stage_terms.append([float(term[c, j, nxt - 1, h]) for term in self.terms])
            if nxt == n:
                break
            link_terms.append(float(self.link[nxt - 1, c, c_next]))
            c, multiset, j = c_next, rest, nxt
        periods = tuple(max([t[g] for t in stage_terms] + [w * x for x in link_terms])
                        for g, w in enumerate(self.link_weights))
        return _Path(stages, total, periods)

    def placement(self, path: _Path) -> Placement:
        """Concrete devices for a path: each class's lowest indices first, in pipeline order."""
        taken = [0] * self.num_classes
        devices = []
        for c, *_ in path.stages:
            devices.append(self.members[c][taken[c]])
            taken[c] += 1
        return Placement(tuple(devices), tuple((a, b) for _, a, b, _, _ in path.stages),
                         tuple(r for *_, r, _ in path.stages), tuple(s for *_, s in path.stages))


class _Search:
    """The branch and bound over boxes of threshold candidates (indices into ``cands``, per period)."""

    def __init__(self, dp: ThresholdDP, cands: list[np.ndarray], upper_s: float | None) -> None:
        self.dp, self.cands, self.m = dp, cands, dp.m
        self.best: _Path | None = None
        self.best_value = math.inf if upper_s is None else upper_s
        self.heap: list[_Box] = []
        self.runs = 0

    def value(self, path: _Path) -> float:
        """The step time of a path: its sum plus (m - 1) times its periods."""
        return linear_step(path.total_s, self.m, sum(path.periods))

    def run(self, at: tuple[int, ...], cutoff: float = math.inf) -> _Path | None:
        path = self.dp.run(tuple(float(c[i]) for c, i in zip(self.cands, at, strict=True)), cutoff)
        self.runs += 1
        if path is not None and self.value(path) < self.best_value:
            self.best, self.best_value = path, self.value(path)
        return path

    def lowest(self, lo: tuple[int, ...]) -> float:
        """(m - 1) times the smallest thresholds of a box."""
        return linear_step(0.0, self.m, sum(float(c[i]) for c, i in zip(self.cands, lo, strict=True)))

    def push(self, lo: tuple[int, ...], hi: tuple[int, ...], sum_bound: float) -> None:
        """Queue a box whose sums are >= ``sum_bound``, unless its bound cannot beat the best."""
        if any(a > b for a, b in zip(lo, hi, strict=True)):
            return
        bound = sum_bound + self.lowest(lo)
        limit = self.best_value * (1 - REL_TOL)
        if bound >= limit:
            return
        # Thresholds so large that the bound alone reaches the best placement: cut them off.
        room = (limit - bound) / (self.m - 1) if self.m > 1 else math.inf
        hi = tuple(min(b, int(np.searchsorted(c, c[a] + room, side="left")) - 1)
                   for a, b, c in zip(lo, hi, self.cands, strict=True))
        heapq.heappush(self.heap, _Box(bound, lo, hi, sum_bound))

    def settle(self, box: _Box, mid: tuple[int, ...], path: _Path | None) -> None:
        """Split a box around the DP at ``mid``: what is not <= mid keeps the box's sum bound; what is
        <= mid but not >= the path's periods has sums >= the path's; [periods, mid] is settled. No
        path: nothing below mid fits (or, with a cutoff, beats the best), so that part is dropped."""
        lo, hi, dims = box.lo, box.hi, len(box.lo)
        for d in range(dims):  # dimension d above mid, the earlier ones at most mid
            self.push(tuple(mid[d] + 1 if x == d else lo[x] for x in range(dims)),
                      tuple(hi[x] if x >= d else mid[x] for x in range(dims)), box.sum_bound)
        if path is None:
            return
        q = tuple(max(a, int(np.searchsorted(c, p))) for a, c, p in zip(lo, self.cands, path.periods, strict=True))
        for d in range(dims):  # at most mid, dimension d below the path's, the earlier ones in [q, mid]
            self.push(tuple(q[x] if x < d else lo[x] for x in range(dims)),
                      tuple(q[d] - 1 if x == d else mid[x] for x in range(dims)), path.total_s)

    def search(self, deadline: float | None) -> float:
        """Run to the end; returns the smallest bound of the box in hand (inf when none was)."""
        top = tuple(len(c) - 1 for c in self.cands)
        first = self.run(top)
        if first is None:
            return math.inf  # nothing fits at any threshold
        self.settle(_Box(0.0, tuple(0 for _ in top), top, first.total_s), top, first)
        while self.heap:
            box = heapq.heappop(self.heap)
            if box.lower >= self.best_value * (1 - REL_TOL):
                self.heap.clear()
                break
            try:
                check(deadline)
                # Halve the box in seconds, not in candidates: they crowd where many stages look alike.
                mid = tuple(min(b, max(a, int(np.searchsorted(c, (c[a] + c[b]) / 2))))
                            for a, b, c in zip(box.lo, box.hi, self.cands, strict=True))
                # Below mid a sum past the cutoff cannot beat the best placement: the DP drops such partials.
                path = self.run(mid, self.best_value * (1 - REL_TOL) - self.lowest(box.lo))
            except OutOfTime:
                heapq.heappush(self.heap, box)
                raise
            self.settle(box, mid, path)
        return math.inf


def solve_exact(table: CostTable, num_stages: int | None = None, deadline: float | None = None,
                upper_s: float | None = None, shared: SharedCosts | None = None) -> ExactResult:
    """The optimal placement under objective.pipeline_step_time, by the threshold search.

    ``upper_s``: the step time of a known feasible placement (pruning only: when nothing beats it the
    result is proven with no placement and lower bound ``upper_s``). ``deadline`` (time.perf_counter()):
    past it the best placement so far is returned, unproven, with a lower bound when one is known.
    ``shared``: stage cost arrays shared with other solves on sub-fleets of the same table (SharedCosts).
    """
    dp = ThresholdDP(table, num_stages, deadline, shared=shared)
    if dp.too_big():
        return ExactResult(None, None, False, None, 0,
                           f"{dp.num_classes} device classes make {dp.states:,} DP states (the exact DP "
                           f"stops at {MAX_STATES:,})")
    search: _Search | None = None
    try:
        dp.prepare()
        cands = dp.candidates()
        if any(len(c) == 0 for c in cands):
            return ExactResult(None, None, True, None, 0)  # no stage fits anywhere
        search = _Search(dp, cands, upper_s)
        search.search(deadline)
    except OutOfTime:
        if search is None or search.runs == 0:
            return ExactResult(None, None, False, None, 0, "the exact DP ran out of time")
        best = search.best
        bound = min([b.lower for b in search.heap] + [search.best_value])
        return ExactResult(dp.placement(best) if best else None, search.value(best) if best else None, False,
                           None if math.isinf(bound) else bound, search.runs, "the exact DP ran out of time")
    if search.best is None:  # nothing fits, or nothing beats upper_s
        return ExactResult(None, None, True, upper_s, search.runs)
    return ExactResult(dp.placement(search.best), search.best_value, True, search.best_value, search.runs)
