"""The packing DP of data x pipeline replicas: disjoint replicas whose shares sum to the step's M.

Replicas are multisets of device classes (``ClassMultisets``); for one threshold tau the search
(planner/replica/replicas.py) lists every replica option with T <= tau at each share, and ``pack`` finds the
least total reduction over (devices left, micro-batches left, coordinator placed?, replicas left),
with the packing that reaches it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from hetero.planner.model.cost import CostTable
from hetero.planner.replica.replica_fronts import INF, ClassPipeline, Frontier
from hetero.planner.search.deadline import check

# A replica option at one share: (share, reduction, reduction as the coordinator's replica, pipeline,
# pipeline as the coordinator's (None: not solved yet, its T only bounded), their T (or bound)).
Entry = tuple[int, float, float, "ClassPipeline | None", "ClassPipeline | None", float, float]
Options = dict[int, tuple[bool, list[Entry]]]  # per multiset: (reduction the same at every share, entries)
Picked = list[tuple[int, int, "ClassPipeline | None", bool]]  # (multiset, share, pipeline, is the coordinator's)


@dataclass
class ClassMultisets:
    """Every sub-multiset of the fleet's device classes, numbered in mixed radix (the last, ``full``,
    is the whole fleet), and which of them a packing DP state may take next."""

    classes: list[int]  # per device, its class (CostTable.device_classes)
    members: list[list[int]]  # per class, its devices
    host: list[int]  # per class, its host
    stride: list[int]  # per class, its digit's weight in a multiset's index
    multisets: list[tuple[int, ...]]  # per index, the count of each class
    size: list[int]  # per multiset, its number of devices
    hosts_of: list[set[int]]  # per multiset, the hosts of its devices
    subsets: list[list[int]]  # per multiset, its non-empty sub-multisets
    lowest: list[int]  # per multiset, its lowest class present
    # Per multiset S: the replicas U <= S holding a device of S's lowest class (the others are
    # packed later, or left idle: no packing is counted twice per order of its replicas).
    subs: list[list[int]]

    @property
    def full(self) -> int:
        return len(self.multisets) - 1

    @staticmethod
    def count(table: CostTable) -> int:
        """How many multisets ``of`` would number (the empty one included), without building them."""
        classes = table.device_classes()
        return math.prod(classes.count(k) + 1 for k in range(max(classes) + 1))

    @staticmethod
    def of(table: CostTable, deadline: float | None = None) -> ClassMultisets:
        """The multisets of ``table``'s device classes (raises OutOfTime past ``deadline``)."""
        classes = table.device_classes()
        members = [[d for d, c in enumerate(classes) if c == k] for k in range(max(classes) + 1)]
        host = [table.host_of[mem[0]] for mem in members]
        avail = tuple(len(mem) for mem in members)
        stride = [math.prod(a + 1 for a in avail[:k]) for k in range(len(avail))]
        multisets = sorted(itertools.product(*(range(a + 1) for a in avail)),
                           key=lambda counts: sum(x * s for x, s in zip(counts, stride, strict=True)))
        full = len(multisets) - 1
        counts = np.array(multisets)
        subsets = []
        for u in range(full + 1):
            check(deadline)
            subsets.append(np.flatnonzero((counts <= counts[u]).all(axis=1))[1:].tolist())
        lowest = [next((k for k, x in enumerate(s) if x), 0) for s in multisets]
        subs = [[u for u in subsets[s] if u != full and multisets[u][lowest[s]]] for s in range(full + 1)]
        return ClassMultisets(classes, members, host, stride, multisets, [sum(u) for u in multisets],
                              [{host[k] for k, x in enumerate(u) if x} for u in multisets], subsets, lowest, subs)


def front_entry(front: Frontier, m: int, tau: float, hi: int) -> Entry:
    """An enumerated replica's option at share m (its fronts may come from a larger share: no slower)."""
    (red, pipe), (red_c, pipe_c) = (front.at(tau, hi, lead) for lead in (False, True))
    return (m, red, red_c, pipe, pipe_c, pipe.time_s if pipe else INF, pipe_c.time_s if pipe_c else INF)


# A DP state: (multiset of devices left, micro-batches left, coordinator still to place?, replicas left).
_State = tuple[int, int, bool, "int | None"]


class _Packing:
    """One packing DP over the options, memoized with each state's choice."""

    def __init__(self, sets: ClassMultisets, opts: Options, exact_count: bool, deadline: float) -> None:
        self.sets, self.opts, self.exact_count, self.deadline = sets, opts, exact_count, deadline
        self.memo: dict[_State, tuple[float, tuple | None]] = {}  # type: ignore[type-arg]
        self.useful: dict[tuple[int, int], list[Entry]] = {}
        self.taken: dict[int, list[int]] = {}

    def shares(self, u: int, mu: int) -> list[Entry]:
        """U's entries with share <= mu that no larger share beats on both reductions (a larger
        share leaves fewer micro-batches to the rest)."""
        if (u, mu) not in self.useful:
            fixed, entries = self.opts[u]
            keep, least, least_c = [], INF, INF
            for e in reversed(entries[:mu]):
                if e[1] < least or e[2] < least_c:
                    keep.append(e)
                    least, least_c = min(least, e[1]), min(least_c, e[2])
                if fixed:
                    break
            self.useful[(u, mu)] = keep
        return self.useful[(u, mu)]

    def g(self, s: int, mu: int, need: bool, left: int | None) -> float:
        """The least total reduction from this state (inf: no packing completes it)."""
        if mu == 0:
            return INF if need or (self.exact_count and left) else 0.0
        if s == 0 or left == 0:
            return INF
        key = (s, mu, need, left)
        found = self.memo.get(key)
        if found is not None:
            return found[0]
        check(self.deadline)
        nxt = None if left is None else left - 1
        sets, g = self.sets, self.g
        best, choice = g(s - sets.stride[sets.lowest[s]], mu, need, left), None  # that device idles
        for u in self.subs(s):
            for m, red, red_c, pipe, pipe_c, t, t_c in self.shares(u, mu):
                if need and red_c < best:
                    v = red_c + g(s - u, mu - m, False, nxt)
                    if v < best:
                        best, choice = v, (u, m, pipe_c, True, t_c)
                if red < best:
                    v = red + g(s - u, mu - m, need, nxt)
                    if v < best:
                        best, choice = v, (u, m, pipe, False, t)
        self.memo[key] = (best, choice)
        return best

    def subs(self, s: int) -> list[int]:
        """The replicas S may take next that have options (ClassMultisets.subs, filtered once per packing)."""
        found = self.taken.get(s)
        if found is None:
            found = self.taken[s] = [u for u in self.sets.subs[s] if u in self.opts]
        return found

    def walk(self, state: _State) -> tuple[float, Picked]:
        """The replicas of the least packing from ``state`` (solved by g first), and their largest T."""
        slowest, picked = 0.0, []
        s, mu, need, left = state
        while mu > 0:
            choice = self.memo[(s, mu, need, left)][1]
            if choice is None:
                s -= self.sets.stride[self.sets.lowest[s]]
                continue
            u, m, pipe, lead, t = choice
            picked.append((u, m, pipe, lead))
            slowest = max(slowest, t)
            s, mu, need, left = s - u, mu - m, need and not lead, None if left is None else left - 1
        return slowest, picked


class _Arrays:
    """The packing DP bottom-up over every multiset at once, when the replicas are not counted: g[s][mu][need],
    the least total reduction of multiset s's devices carrying mu micro-batches, the coordinator's replica still
    to place if need (that layer only where ``need``). Each multiset's row is one array operation over the
    replicas it may take next and their shares (the memoized ``_Packing`` visits them one at a time)."""

    def __init__(self, sets: ClassMultisets, opts: Options, total_mb: int, need: bool, deadline: float) -> None:
        self.sets, self.size = sets, total_mb + 1
        count, size = len(sets.multisets), self.size
        self.red = np.full((count, size), INF)
        self.red_c = np.full((count, size), INF)
        self.entry: dict[tuple[int, int], Entry] = {}
        for u, (_, entries) in opts.items():
            for e in entries:  # one per share
                self.red[u, e[0]], self.red_c[u, e[0]], self.entry[(u, e[0])] = e[1], e[2], e
        left, share = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
        self.back = np.clip(left - share, 0, None)  # [mu][m]: the micro-batches left after a replica of share m
        self.mask = np.where((share >= 1) & (share <= left), 0.0, INF)
        self.takes = [np.array([u for u in sets.subs[s] if u in opts], dtype=int) for s in range(count)]
        g = self.g = np.full((count, size, 2 if need else 1), INF)
        g[:, 0, 0] = 0.0
        for s in range(1, count):
            check(deadline)
            row = g[s - sets.stride[sets.lowest[s]]].copy()  # that device idles
            if (us := self.takes[s]).size:
                for layer, values in enumerate(self.candidates(s, us)):
                    row[:, layer] = np.minimum(row[:, layer], values.min(axis=(0, 2)))
            g[s] = row

    def candidates(self, s: int, us: np.ndarray) -> list[np.ndarray]:
        """Per layer of g, [u][mu][m]: taking replica u at share m, then the rest (with the coordinator to place:
        u as the coordinator's, or as one of the others)."""
        rows = self.g[s - us]
        red = self.red[us][:, None, :]
        rest = rows[:, self.back, 0] + self.mask
        placed = red + rest
        if rows.shape[2] == 1:
            return [placed]
        lead = self.red_c[us][:, None, :] + rest
        return [placed, np.minimum(lead, red + (rows[:, self.back, 1] + self.mask))]

    def walk(self, s: int, mu: int, need: bool) -> tuple[float, Picked]:
        """The replicas of the least packing from a state, and their largest T."""
        slowest, picked = 0.0, []
        while mu > 0:
            idle = s - self.sets.stride[self.sets.lowest[s]]
            if self.g[idle, mu, int(need)] <= self.g[s, mu, int(need)]:
                s = idle
                continue
            us = self.takes[s]
            options = self.candidates(s, us)[int(need)][:, mu, :]
            k, m = (int(x) for x in np.unravel_index(int(np.argmin(options)), options.shape))
            u, e = int(us[k]), self.entry[(int(us[k]), m)]
            rest = self.g[s - u, mu - m]
            lead_here = bool(need and self.red_c[u, m] + rest[0] <= self.red[u, m] + rest[1])
            picked.append((u, m, e[4] if lead_here else e[3], lead_here))
            slowest = max(slowest, e[6] if lead_here else e[5])
            s, mu, need = s - u, mu - m, need and not lead_here
        return slowest, picked


def pack(sets: ClassMultisets, opts: Options, total_mb: int, need_coordinator: bool, max_replicas: int | None,
         exact_count: bool, deadline: float) -> tuple[float, float, Picked]:
    """The least total reduction of disjoint replicas whose shares sum to ``total_mb``, one of them the
    coordinator's if ``need_coordinator``, at most ``max_replicas`` of them (exactly, with ``exact_count``):
    (reduction, the largest T among them, the replicas); inf, inf, [] when none do."""
    if max_replicas is None and not exact_count and not all(fixed for fixed, _ in opts.values()):
        # Reductions that vary with the share: many entries per replica, one array operation per multiset.
        arrays = _Arrays(sets, opts, total_mb, need_coordinator, deadline)
        value = float(arrays.g[sets.full, total_mb, int(need_coordinator)])
        if value == INF:
            return value, INF, []
        slowest, picked = arrays.walk(sets.full, total_mb, need_coordinator)
        return value, (slowest if picked else INF), picked
    dp = _Packing(sets, opts, exact_count, deadline)
    state: _State = (sets.full, total_mb, need_coordinator, max_replicas)
    value = dp.g(*state)
    if value == INF:
        return value, INF, []
    slowest, picked = dp.walk(state)
    return value, (slowest if picked else INF), picked
