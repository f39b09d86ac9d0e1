"""Lower bounds on T(U, m), the best closed-form pipeline on a multiset U of device classes with m micro-batches.

The replica search (planner/replica/replicas.py) enters every T(U, m) it has not solved at a lower bound, and a
packing of replicas is ruled out when its bounds already lose; the tighter the bound, the fewer pipelines
the search must solve before it can prove its answer. A pipeline of s stages on U's devices pays, by the
step form's closed form (planner/schedule/step_form.py), the first micro-batch's round trip plus (m - 1) times the
sum of its period groups' bottlenecks. Each part is bounded from below:

- **the round trip**: every layer's least work on U's classes, plus two hand-offs (down and back) on each
  of the s - 1 links, each at least the least one-way hand-off between two devices of U over every cut, and
  as many of them as s stages must cross between U's hosts at least the least hand-off between two hosts;
- **a period group's bottleneck**: at least the largest layer's least weighted time, the link weight times
  the least hand-off when s >= 2 (between hosts when s stages must cross), and the group's whole least work over the s stages' joint capacity; and
  the groups together at least that bound for their weights summed (one stage's weights in every group).
  A device's capacity is its speed relative to U's fastest per layer (1 / the least ratio, over the
  layers, of its time to the least time): no stage can do more of the least work per second, so the
  slowest of s stages takes at least the least work over the sum of the s largest capacities. The same
  holds for any subset of the layers, so it is also taken over the heavy ones (HEAVY_SHARES): tiny layers
  every device runs alike would otherwise make a slow device look as fast as the fastest;
- **memory**: s stages must hold the frozen weights (the part that may stream left out), LoRA and
  workspace: the s roomiest devices of U must hold the least bytes of every layer.

T(U, m) >= the least, over the s that fit, of round trip(s) + (m - 1) x period(s). With s = |U|, no
hand-offs and every capacity 1 this is the earlier bound W + (m - 1) max(W / |U|, largest layer); every
part above only raises it (tests/unit/test_replica_bound.py checks it against solved pipelines).
"""

from __future__ import annotations

import numpy as np

from hetero.planner.model.cost import CostTable
from hetero.planner.replica.replica_packing import ClassMultisets
from hetero.planner.schedule.step_form import step_form
from hetero.planner.search.deadline import check

INF = float("inf")


def _hops(table: CostTable, reps: list[int]) -> np.ndarray:
    """[class a][class b]: the least one-way hand-off from a device of a to one of b, over every cut."""
    cuts = range(max(0, table.num_nodes - 1))
    if not table.link_s or not cuts:
        return np.zeros((len(reps), len(reps)))
    host, kind = table.host_of, table.wire_kind
    return np.array([[min(table.link_s[i][kind[a]][host[a]][host[b]] for i in cuts) for b in reps] for a in reps])


# Layer subsets the capacity bound is also taken over: those whose least time is at least this share of the
# largest. A device's capacity is its least ratio over the layers counted, so tiny layers that every device runs
# alike (a norm, an embedding lookup) would otherwise make every device look as fast as the fastest.
HEAVY_SHARES = (0.0, 0.01, 0.1, 0.5)


def _capacity_bound(weighted: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For s = 1..|U| stages: the least work of the layers counted over the s fastest devices' joint capacity."""
    least = weighted.min(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(least[:, None] > 0, weighted / least[:, None], np.inf)
    slowest = ratio.min(axis=0)  # per class, its least ratio over the layers (inf: no layer has work)
    speed = np.where(np.isfinite(slowest), 1.0 / np.maximum(slowest, 1.0), 1.0)
    return float(least.sum()) / np.cumsum(np.sort(np.repeat(speed, counts))[::-1])


def _bottleneck(weighted: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For s = 1..|U| stages: the least the largest stage's weighted time can be, from [node][class] times on U's
    classes: the largest layer's least time, and the least work of every heavy subset over the capacity."""
    least = weighted.min(axis=1)
    bound = np.full(int(counts.sum()), float(least.max()))
    for share in HEAVY_SHARES:
        heavy = least >= share * least.max()
        if heavy.any():
            bound = np.maximum(bound, _capacity_bound(weighted[heavy], counts))
    return bound


def _hand_offs(hops: np.ndarray, counts: np.ndarray, host: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For s = 1..|U| stages on U's devices (counts per class, each class on host[class]): the least seconds of
    their s - 1 one-way hand-offs, and the least their slowest hand-off can take. s stages span at least h(s)
    hosts (the fewest whose devices number s), so at least h(s) - 1 hand-offs cross between hosts."""
    size = int(counts.sum())
    present = np.flatnonzero(counts > 0)
    same = np.array([[host[a] == host[b] for b in present] for a in present])
    # The least hand-off between two distinct devices (a class with one device does not pair with itself) and
    # between two devices on different hosts.
    pairs = hops[np.ix_(present, present)] + np.where(np.diag(counts[present] < 2), INF, 0.0)
    least = float(pairs.min()) if size > 1 else 0.0
    crossing = np.where(same, INF, np.minimum(hops[np.ix_(present, present)], hops[np.ix_(present, present)].T))
    across = float(crossing.min()) if crossing.size else INF
    per_host: dict[int, int] = {}
    for k in present:
        per_host[host[k]] = per_host.get(host[k], 0) + int(counts[k])
    spanned = np.searchsorted(np.cumsum(sorted(per_host.values(), reverse=True)), np.arange(1, size + 1)) + 1
    crossings = spanned - 1
    stages = np.arange(1, size + 1)
    sent = np.where(crossings > 0, crossings * np.where(np.isfinite(across), across, 0.0), 0.0)
    sent = sent + (stages - 1 - crossings) * least
    widest = np.where(crossings > 0, across, np.where(stages >= 2, least, 0.0))
    return sent, widest


def replica_bounds(table: CostTable, sets: ClassMultisets, deadline: float) -> tuple[np.ndarray, np.ndarray]:
    """(lb, period): lb[u][m] <= T(U, m) (inf where no s stages of U hold the model; column 0 unused) and
    period[u], a lower bound on the period groups' sum of any pipeline on U (finite), by the module's bound."""
    t, form = table, step_form(table.schedule)
    reps = [mem[0] for mem in sets.members]
    fwd = np.array(t.fwd_s, dtype=float)[:, reps]
    bwd = np.array(t.bwd_s, dtype=float)[:, reps]
    groups = [(g.stage(fwd, bwd) + np.zeros_like(fwd), g.link) for g in form.groups]
    work = fwd + bwd
    combined = sum((weighted for weighted, _ in groups), np.zeros_like(fwd))
    need = np.array([[t.weights[i][d] - t.stream_bytes[i][d] + t.lora[i][d] for d in reps] for i in range(t.num_nodes)])
    room = np.array([max(0.0, t.usable_bytes[d] - t.workspace_bytes) for d in reps])
    hops = _hops(t, reps)
    total = t.num_micro_batches
    lb = np.full((len(sets.multisets), total + 1), INF)
    period = np.zeros(len(sets.multisets))
    later = np.arange(total)[None, :]  # m - 1 for m = 1..M
    for u in range(1, len(sets.multisets)):
        check(deadline)
        counts = np.array(sets.multisets[u])
        mask = counts > 0
        size = int(counts.sum())
        sent, widest = _hand_offs(hops, counts, sets.host)
        periods = np.zeros(size)
        for weighted, link in groups:
            periods += np.maximum(_bottleneck(weighted[:, mask], counts[mask]), link * widest)
        # The groups' maxima together are at least one stage's weights together (a layer's least of the sum can
        # exceed the sum of its least parts).
        periods = np.maximum(periods, _bottleneck(combined[:, mask], counts[mask]))
        trip = work[:, mask].min(axis=1).sum() + 2.0 * sent
        period[u] = float(periods.min())
        roomiest = np.cumsum(np.sort(np.repeat(room[mask], counts[mask]))[::-1])
        fits = roomiest >= need[:, mask].min(axis=1).sum()
        if fits.any():
            steps = trip[fits][:, None] + later * periods[fits][:, None]
            lb[u, 1:] = steps.min(axis=0)
    return lb, period


class CoordinatorShare:
    """The least gradient reduction of a replica over several hosts, given the step's threshold.

    A replica's reduction sends each layer's gradient bytes from its device's host to the coordinator's; the
    layers on the coordinator's host cost least. Those layers sit on the replica's devices there, and each of
    them computes its span for every one of the replica's m micro-batches within its T <= tau: together they hold
    layers of at most (devices there) x tau / m seconds of least work. The most gradient bytes such layers can
    carry is a fractional knapsack (bytes per second of work, greediest first: no set of whole layers carries
    more), and every other byte leaves from another of the replica's hosts, at least at the cheapest of them."""

    def __init__(self, table: CostTable, sets: ClassMultisets) -> None:
        self.table, self.sets = table, sets
        reps = [mem[0] for mem in sets.members]
        self.work = (np.array(table.fwd_s, dtype=float) + np.array(table.bwd_s, dtype=float))[:, reps]
        self.grad = np.array(table.grad_bytes, dtype=float)
        self.total = float(self.grad.sum())
        self._knapsacks: dict[tuple[int, ...], tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._split: dict[tuple[int, int], tuple[float, float, int, tuple[int, ...]]] = {}

    def most_bytes(self, classes: tuple[int, ...], capacity_s: float) -> float:
        """The most gradient bytes of layers whose least work on ``classes`` sums to at most ``capacity_s``."""
        if classes not in self._knapsacks:
            work = self.work[:, list(classes)].min(axis=1)
            free = work <= 0
            order = np.argsort(-np.where(free, 0.0, self.grad / np.where(free, 1.0, work)), kind="stable")
            order = order[~free[order]]
            self._knapsacks[classes] = (float(self.grad[free].sum()), np.cumsum(work[order]),
                                        np.cumsum(self.grad[order]), work[order], self.grad[order])
        base, cum_w, cum_g, work, grad = self._knapsacks[classes]
        k = int(np.searchsorted(cum_w, capacity_s, side="right"))
        got = base + (float(cum_g[k - 1]) if k else 0.0)
        if k < len(work):
            got += float(grad[k]) * (capacity_s - (float(cum_w[k - 1]) if k else 0.0)) / float(work[k])
        return min(got, self.total)

    def reduction(self, u: int, coordinator: int, tau: float, m: int) -> float:
        """A lower bound on the reduction of any pipeline on multiset ``u`` with ``m`` micro-batches and T <= tau,
        its gradients summed on host ``coordinator``."""
        key = (u, coordinator)
        if key not in self._split:
            sets, cost = self.sets, self.table.reduce_s_per_byte
            counts, hosts = sets.multisets[u], sets.hosts_of[u]
            near = tuple(k for k, x in enumerate(counts) if x and sets.host[k] == coordinator)
            others = [cost[h][coordinator] for h in hosts if h != coordinator]
            far = min(others) if others else INF
            inside = cost[coordinator][coordinator] if near else INF
            self._split[key] = (far, inside, sum(counts[k] for k in near), near)
        far, inside, devices, near = self._split[key]
        if far == INF or inside >= far:
            return self.total * min(far, inside)
        carried = self.most_bytes(near, devices * tau / m)
        return (self.total - carried) * far + carried * inside


def work_floor(table: CostTable) -> float:
    """Every plan's slowest replica takes at least M x the least work / the fleet's devices: each replica's
    busiest device does at least its devices' share of its micro-batches' least work."""
    least = sum(min(f + b for f, b in zip(fwd, bwd, strict=True)) for fwd, bwd in zip(table.fwd_s, table.bwd_s,
                                                                                      strict=True))
    return table.num_micro_batches * least / table.num_devices


def parallel_bound(table: CostTable) -> float:
    """A lower bound on every plan of R >= 2 replicas: the slowest replica's ``work_floor``, and at least two
    replicas send every gradient byte through the cheapest path to a coordinator."""
    hosts = sorted(set(table.host_of))
    cheapest = min(table.reduce_s_per_byte[a][b] for a in hosts for b in hosts)
    return work_floor(table) + 2.0 * sum(table.grad_bytes) * cheapest
