"""Good placements fast: for chosen device orders, good contiguous splits by dynamic programming.

These are MIP starts and upper bounds for the ILP (planner/search/ilp.py), which stays the solver of
record: a tight upper bound lets it prune most arcs before CBC runs. For one device order the DP
first finds the smallest possible period P* (the max term of the objective: slowest stage or
link), then the smallest sum of stage and link times among splits whose period stays within
P* x (1 + slack) for a few slacks; every result is scored with objective.evaluate. Orders are
every order of every device subset modulo identical twins when there are few, else heuristic
ones (fastest first, roomiest first, hosts together, ...). Not exact: the ILP proves the optimum.
"""

from __future__ import annotations

from itertools import permutations

from hetero.planner.model.cost import CostTable, in_flight
from hetero.planner.model.objective import Evaluation, Placement, evaluate, stage_choice
from hetero.planner.search.deadline import left

INF = float("inf")
SLACKS = (0.0, 0.03, 0.1, 0.3)


def _prefix(rows: list[list[float]], d: int) -> list[float]:
    out = [0.0]
    for row in rows:
        out.append(out[-1] + row[d])
    return out


class _Prefix:
    """Per-device prefix sums of time and memory, so a span's cost is two lookups."""

    def __init__(self, table: CostTable) -> None:
        nd = table.num_devices
        self.t = [[f + b for f, b in zip(pf, pb, strict=True)]
                  for pf, pb in ((_prefix(table.fwd_s, d), _prefix(table.bwd_s, d)) for d in range(nd))]
        self.table = table
        self._fit: dict[tuple[int, int, int], int] = {}

    def last_fitting(self, d: int, i: int, held: int) -> int:
        """The last node j such that nodes i..j fit on d holding ``held`` micro-batches, recomputing
        and streaming as planner.recompute and planner.offload allow (i-1 if none)."""
        key = (d, i, held)
        if key not in self._fit:
            self._fit[key] = self._last_fitting(d, i, held)
        return self._fit[key]

    def _last_fitting(self, d: int, i: int, held: int) -> int:
        table, n = self.table, self.table.num_nodes
        j = i
        w = lo = 0.0
        while j < n:
            w += table.weights[j][d]
            lo += table.lora[j][d]
            if stage_choice(table, d, i, j, held, w, lo) is None:
                break
            j += 1
        return j - 1


class _OrderSplits:
    """The split DPs of one device order: per stage the nodes it fits and its incoming link's time."""

    def __init__(self, table: CostTable, order: tuple[int, ...], pre: _Prefix) -> None:
        n, s, m = table.num_nodes, len(order), table.num_micro_batches
        self.n, self.s, self.order, self.pre = n, s, order, pre
        self.ends = [[pre.last_fitting(d, i, in_flight(table.schedule, s - 1 - k, m)) for i in range(n)]
                     for k, d in enumerate(order)]
        # link[k][i]: the time of the link into stage k when it starts at node i, weighed as in the
        # schedule's period (1F1B: 2x, both ways in one period; GPipe: 1x, one way per phase).
        factor = table.form.link_weight
        self.link = [[0.0] * n] + [[factor * table.transfer_s(i - 1, order[k - 1], order[k]) if i > 0 else INF
                                    for i in range(n)] for k in range(1, s)]

    def stage(self, k: int, i: int, j: int) -> float:
        """Stage k's forward + backward time over nodes i..j."""
        t = self.pre.t[self.order[k]]
        return t[j + 1] - t[i]

    def least_period(self) -> float:
        """The smallest possible period (slowest stage or link): a bottleneck DP from the end, best[k][i]
        = smallest period of stages k.. covering nodes i.."""
        n, s, ends, link = self.n, self.s, self.ends, self.link
        best = [[INF] * (n + 1) for _ in range(s + 1)]
        best[s][n] = 0.0
        for k in range(s - 1, -1, -1):
            for i in range(n - (s - k) + 1):
                top = min(ends[k][i], n - (s - k))
                if k == s - 1:
                    top = ends[k][i] if ends[k][i] == n - 1 else -1
                    lo = n - 1 if top == n - 1 else top + 1
                else:
                    lo = i
                for j in range(lo, top + 1):
                    v = max(self.stage(k, i, j), link[k][i] if k else 0.0, best[k + 1][j + 1])
                    if v < best[k][i]:
                        best[k][i] = v
        return best[0][0]

    def least_total(self, cap: float) -> tuple[tuple[int, int], ...] | None:
        """The spans with the smallest sum of stage and link times whose period stays within ``cap``."""
        n, s, ends, link = self.n, self.s, self.ends, self.link
        total = [[INF] * (n + 1) for _ in range(s + 1)]
        choice = [[-1] * (n + 1) for _ in range(s + 1)]
        total[s][n] = 0.0
        for k in range(s - 1, -1, -1):
            for i in range(n - (s - k) + 1):
                if k and link[k][i] > cap:
                    continue
                top = min(ends[k][i], n - (s - k))
                for j in range(i if k < s - 1 else n - 1, top + 1 if k < s - 1 else ends[k][i] + 1):
                    t = self.stage(k, i, j)
                    if t > cap:
                        break
                    v = t + (link[k][i] if k else 0.0) + total[k + 1][j + 1]
                    if v < total[k][i]:
                        total[k][i], choice[k][i] = v, j
        if total[0][0] == INF:
            return None
        spans, i = [], 0
        for k in range(s):
            j = choice[k][i]
            spans.append((i, j))
            i = j + 1
        return tuple(spans)


def split_for_order(table: CostTable, order: tuple[int, ...], pre: _Prefix | None = None) -> list[Placement]:
    """Candidate splits of all nodes over ``order`` (every device gets at least one node)."""
    if len(order) > table.num_nodes:
        return []
    dp = _OrderSplits(table, order, pre or _Prefix(table))
    period = dp.least_period()
    if period == INF:
        return []
    out = []
    for slack in SLACKS:
        spans = dp.least_total(period * (1 + slack) * (1 + 1e-12))
        if spans is not None:
            out.append(Placement(order, spans))
    return out


def _orders(table: CostTable, size: int, limit: int) -> list[tuple[int, ...]]:
    """Device orders of ``size`` devices modulo identical twins; heuristic ones past ``limit``."""
    nd = table.num_devices
    label = table.device_classes()
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[int, ...]] = []
    for count, perm in enumerate(permutations(range(nd), size)):
        if count >= 50 * limit:
            break
        sig = tuple(label[d] for d in perm)
        if sig not in seen:
            seen.add(sig)
            out.append(perm)
            if len(out) > limit:
                break
    else:
        return out  # every order (modulo twins) was enumerated
    # Too many: fastest first, roomiest first, fleet order, and hosts kept together.
    speed = sorted(range(nd), key=lambda d: sum(r[d] for r in table.fwd_s))
    room = sorted(range(nd), key=lambda d: -table.usable_bytes[d])
    by_host = sorted(range(nd), key=lambda d: (table.host_of[d], speed.index(d)))
    # Under 1F1B early stages hold more micro-batches: put the cards that fit the most layers
    # (holding min(m, size) micro-batches) first.
    held = in_flight(table.schedule, size - 1, table.num_micro_batches)
    per_node = [sum(table.weights[i][d] + table.lora[i][d] + held * table.activations_per_mb[i][d]
                    for i in range(table.num_nodes)) for d in range(nd)]
    layers = sorted(range(nd), key=lambda d: -(table.usable_bytes[d] - table.workspace_bytes) / per_node[d])
    cands = {tuple(o[:size]) for o in (speed, room, list(range(nd)), by_host, layers)}
    cands |= {tuple(reversed(o)) for o in cands}
    return sorted(cands)


def dp_starts(table: CostTable, num_stages: int | None = None, limit: int = 60,
              deadline: float | None = None) -> list[Evaluation]:
    """Feasible placements from the split DP over device orders, best first (those found by
    ``deadline``, a time.perf_counter() value)."""
    pre = _Prefix(table)
    sizes = [num_stages] if num_stages else range(1, min(table.num_nodes, table.num_devices) + 1)
    found: list[Evaluation] = []
    seen: set[Placement] = set()
    for size in sizes:
        for order in _orders(table, size, limit):
            if left(deadline) <= 0:
                break
            for placement in split_for_order(table, order, pre):
                if placement in seen:
                    continue  # several slacks often give the same split
                seen.add(placement)
                ev = evaluate(table, placement)
                if ev.feasible:
                    found.append(ev)
    found.sort(key=lambda e: e.step_time_s)
    return found
