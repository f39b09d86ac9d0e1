"""The layered network the placement ILP routes one path through (see planner/search/ilp.py).

- State A(i, q, g): the next stage starts at node i, q stages remain (capped, see below), and the
  previous stage's sender group g (host + wire bytes per cut) decides the incoming link's cost.
- Link arc A(i, q, g) -> B(i, q, h): the activation after node i-1 travels from g's host to host
  h (cost 2c: forward and backward). Stages that start at node 0 leave from the source directly.
- Stage arc B(i, q, host(d)) -> A(j+1, q', group(d)): device d runs nodes i..j. Its f+b comes from
  the cost table; arcs whose memory does not fit with the state's micro-batches in flight are
  never created, so memory needs no constraints at all.
- Under 1F1B the stage with r stages remaining holds min(r, m) micro-batches. q is r capped at the
  smallest Q such that "fits holding Q" and "fits holding the most possible" agree for every arc
  (Q = 1 when memory is loose); a free arc A(i, Q, g) -> A(i, Q-1, g) leaves the capped layer.
  GPipe holds m everywhere: one layer. When the layers would make too many arcs, the network is
  flat instead and the ILP bounds the stages after each tight arc with rows.

Arcs that cannot be in an optimum are pruned: a stage of time t costs at least m*t plus the
fastest time of every other node (and, below the cap, the q-1 stages after it share the nodes
after it), and a known placement bounds the optimum from above.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import (
    Placement,
    ram_may_bind,
    recompute_time_s,
    resident_weights,
    stage_activations,
    stage_choice,
    stage_fits,
    stage_pareto,
    stream_terms,
)
from hetero.planner.schedule.step_form import linear_step
from hetero.planner.search.deadline import check

# Pruning keeps an arc unless its lower bound exceeds the upper bound by this much (float noise).
PRUNE_TOL = 1e-6
# Above this many stage arcs the in-flight states are dropped for rows (LP time grows with arcs).
LAYERED_ARCS = 25000


@dataclass(frozen=True)
class StageArc:
    """Device ``device`` runs nodes first..last in state ``state``; times in units of ``Network.unit``."""

    device: int
    first: int
    last: int
    state: int
    fwd: float
    bwd: float  # including the forward its recomputing layers repeat
    held: int = 0  # micro-batches in flight that fit (flat networks check it with rows instead)
    recompute: int = 0  # how many of its decoder layers recompute (with stream: the pair of least time that fits)
    stream: int = 0  # how many of its decoder layers stream their frozen weights from host RAM
    host_bytes: float = 0.0  # the frozen bytes those keep in its host's RAM (the ILP's RAM rows)


@dataclass(frozen=True)
class LinkArc:
    """The activation after node cut-1 goes from sender group ``group`` to host ``host`` (one way)."""

    cut: int
    state: int
    group: int
    host: int
    time: float


@dataclass
class Network:
    """The pruned layered network of one planning problem."""

    unit: float  # seconds per time unit: a lower bound on the step time (the objective is >= 1)
    cap: int  # the capped state Q
    start_states: list[int]
    stages: list[StageArc]
    links: list[LinkArc]
    group_of: list[int]  # sender group per device
    twins: list[tuple[int, int]]  # (a, b): identical devices, a used first
    flat: bool = False  # one layer; in-flight memory as rows on the arcs with held < most_held
    most_held: int = 1
    most_stages: int = 1


def _twins(table: CostTable) -> list[tuple[int, int]]:
    """Consecutive pairs of interchangeable devices (one class: same host, identical cost-table columns)."""
    pairs: list[tuple[int, int]] = []
    seen: dict[int, int] = {}
    for d, cls in enumerate(table.device_classes()):
        if cls in seen:
            pairs.append((seen[cls], d))
        seen[cls] = d  # chain consecutive twins: a<b<c gives (a,b), (b,c)
    return pairs


def canonical(placement: Placement, twins: list[tuple[int, int]]) -> Placement:
    """The same placement with each twin group's lowest indices used first, in pipeline order."""
    group: dict[int, int] = {}
    for a, b in twins:
        group[b] = group.get(a, a)
        group.setdefault(a, a)
    members: dict[int, list[int]] = defaultdict(list)
    for d in sorted(group):
        members[group[d]].append(d)
    taken: dict[int, int] = defaultdict(int)
    devices = []
    for d in placement.devices:
        if d in group:
            root = group[d]
            devices.append(members[root][taken[root]])
            taken[root] += 1
        else:
            devices.append(d)
    return Placement(tuple(devices), placement.spans)


def _recompute_by_held(table: CostTable, d: int, i: int, j: int, w: float, lo: float, most: int,
                       working: float, pareto: bool) -> list[tuple[tuple[int, int], ...] | None]:
    """[h-1] -> the (recompute, stream) pair of least time with which nodes i..j fit on d holding h
    micro-batches (objective.stage_choice); with ``pareto`` (host RAM may bind) every pair no other beats
    in both time and RAM (objective.stage_pareto). None: nothing fits."""
    if pareto:
        return [tuple(stage_pareto(table, d, i, j, h, w, lo, working)) or None for h in range(1, most + 1)]
    pairs = [stage_choice(table, d, i, j, h, w, lo, working=working) for h in range(1, most + 1)]
    return [None if pair is None else (pair,) for pair in pairs]


@dataclass(frozen=True)
class _Scale:
    """The problem's time unit, per-node lower bounds in it, and the pruning bound."""

    unit: float  # seconds: every node on its fastest device, a lower bound on any step time
    fastest: list[float]  # per node, its fastest device's f+b, in units
    all_fastest: float  # sum(fastest)
    bound: float  # upper bound on the objective, in units (inf: none known)
    most_stages: int
    most_held: int  # micro-batches in flight a stage may hold at most


def _scale(table: CostTable, num_stages: int | None, upper_s: float | None) -> _Scale:
    """The unit, the fastest time of every node and the bound a known placement gives."""
    n, nd, m = table.num_nodes, table.num_devices, table.num_micro_batches
    # The unit: every node on its fastest device, a lower bound on any step time. So the objective is
    # >= 1 and CBC's absolute tolerances (its cutoff increment) are relative ones (not 1e-5 of a slow
    # device's whole-model time, which let it call a placement 0.015% from the optimum optimal).
    fastest_s = [min(table.fwd_s[i][d] + table.bwd_s[i][d] for d in range(nd)) for i in range(n)]
    unit = sum(fastest_s) or 1.0
    most_stages = num_stages or min(n, nd)
    fastest = [t / unit for t in fastest_s]
    bound = float("inf") if upper_s is None else upper_s / unit * (1 + PRUNE_TOL) + 1e-12
    return _Scale(unit, fastest, sum(fastest), bound, most_stages, table.form.most_held(m, most_stages))


# A stage candidate: (device, first, last, fwd s, bwd s, [(recompute, stream) holding 1..most_held]).
_Candidate = tuple[int, int, int, float, float, list[tuple[tuple[int, int], ...] | None]]


def _stage_candidates(table: CostTable, scale: _Scale, deadline: float | None) -> list[_Candidate]:
    """Every span on every device that fits holding one micro-batch and can beat the bound.

    Running sums add in evaluate's order. Recomputation is chosen per arc, not by a variable: for a
    given stage and micro-batches in flight the fewest layers that fit is also the fastest choice."""
    n, nd, m = table.num_nodes, table.num_devices, table.num_micro_batches
    by_position = table.form.by_position
    pareto = ram_may_bind(table)
    cands = []
    for d in range(nd):
        for i in range(n):
            check(deadline)
            f = b = w = lo = rest = 0.0
            working = 0.0
            for j in range(i, n):
                f += table.fwd_s[j][d]
                b += table.bwd_s[j][d]
                w += table.weights[j][d]
                lo += table.lora[j][d]
                if table.recomputable and table.recomputable[j]:
                    working = max(working, table.activations_per_mb[j][d])
                rest += scale.fastest[j]
                choices = table.recompute_choices(i, j)
                least = min(stage_activations(table, d, i, j, 1, r, working) for r in {choices[0], choices[-1]})
                s = table.stream_choices(d, i, j)[-1]  # the least resident weights: none or the most streaming
                resident = min(w, resident_weights(table, d, w, stream_terms(table, d, j, s)[0], s))
                if not stage_fits(table, d, resident, lo, least):
                    break  # longer spans only need more memory
                t = (f + b) / scale.unit
                if m * t + (scale.all_fastest - rest) > scale.bound:
                    break  # longer spans only take longer
                by_held = _recompute_by_held(table, d, i, j, w, lo, scale.most_held, working, pareto)
                if by_position or by_held[table.form.held(0, m) - 1] is not None:
                    cands.append((d, i, j, f, b, by_held))
    return cands


def _capped_state(cands: list[_Candidate], most_held: int, by_position: bool) -> int:
    """The smallest Q past which no arc's recomputation (or fitting at all) changes any more (1 when
    every stage holds alike, wherever it is)."""
    if not by_position:
        return 1
    cap = 1
    for *_, by_held in cands:
        h = most_held
        while h > 1 and by_held[h - 2] == by_held[most_held - 1]:
            h -= 1
        cap = max(cap, h)
    return cap


def _variants(by_held: list[tuple[tuple[int, int], ...] | None], table: CostTable, cap: int, flat: bool,
              most_held: int) -> list[tuple[int, int, tuple[tuple[int, int], ...] | None]]:
    """The (state, held, (recompute, stream)) arcs of one candidate."""
    if not table.form.by_position:
        held = table.form.held(0, table.num_micro_batches)
        return [(1, held, by_held[held - 1])]
    if flat:
        # One arc per recomputation that is the fewest for some micro-batch count, holding the
        # most micro-batches it fits; the rows bound the stages after it.
        variants: list[tuple[int, int, tuple[tuple[int, int], ...] | None]] = []
        for h in range(most_held, 0, -1):
            r = by_held[h - 1]
            if r is not None and all(r != v[2] for v in variants):
                variants.append((1, h, r))
        return variants
    # State q < cap holds q micro-batches; the capped state holds cap..most_held, alike by construction.
    return [(q, q if q < cap else most_held, by_held[(q if q < cap else most_held) - 1])
            for q in range(1, cap + 1)]


def _stage_arcs(table: CostTable, scale: _Scale, cands: list[_Candidate], cap: int, flat: bool,
                deadline: float | None) -> list[StageArc]:
    """The stage arcs of every candidate and state that can beat the bound."""
    n, m, unit = table.num_nodes, table.num_micro_batches, scale.unit
    # after[j]: the fastest possible time of nodes j.. (for the states' lower bounds below).
    after = [0.0] * (n + 1)
    for k in range(n - 1, -1, -1):
        after[k] = after[k + 1] + scale.fastest[k]
    stage_arcs = []
    for count, (d, i, j, f, b, by_held) in enumerate(cands):
        if count % 256 == 0:
            check(deadline)
        arcs = [(q, h, pair) for q, h, pairs in _variants(by_held, table, cap, flat, scale.most_held)
                for pair in pairs or ()]
        for q, held, (r, s) in arcs:
            # A stage ending the model has exactly one stage remaining (itself).
            if j == n - 1 and q != 1:
                continue
            if j < n - 1 and q == 1 and cap > 1:
                continue
            extra = recompute_time_s(table, d, i, j, r)
            host_bytes, copy_s = stream_terms(table, d, j, s)
            t = (f + copy_s + b + extra + copy_s) / unit
            base = scale.all_fastest - (after[i] - after[j + 1]) + t
            # Below the cap exactly q-1 stages follow: one of them takes at least their average.
            tail = after[j + 1] / (q - 1) if 1 < q < cap else 0.0
            if linear_step(base, m, max(t, tail)) > scale.bound:
                continue
            stage_arcs.append(StageArc(d, i, j, q, (f + copy_s) / unit, (b + extra + copy_s) / unit, held, r, s,
                                       host_bytes))
    return stage_arcs


def _sender_groups(table: CostTable) -> tuple[list[int], list[int]]:
    """(group per device, a representative device per group): devices of one host and wire kind."""
    groups: dict[tuple[int, int], int] = {}
    group_of, group_rep = [], []
    for d in range(table.num_devices):
        key = (table.host_of[d], table.wire_kind[d])
        if key not in groups:
            groups[key] = len(groups)
            group_rep.append(d)
        group_of.append(groups[key])
    return group_of, group_rep


def _link_arcs(table: CostTable, scale: _Scale, group_rep: list[int], cap: int,
               deadline: float | None) -> list[LinkArc]:
    """Every (cut, state, sender group, receiving host) link that can beat the bound."""
    host_rep: dict[int, int] = {}
    for d in range(table.num_devices):
        host_rep.setdefault(table.host_of[d], d)
    link_arcs = []
    for i in range(1, table.num_nodes):
        check(deadline)
        for g, sender in enumerate(group_rep):
            for h, receiver in host_rep.items():
                c = table.transfer_s(i - 1, sender, receiver) / scale.unit
                if scale.all_fastest + 2 * table.num_micro_batches * c > scale.bound:
                    continue
                for q in range(1, cap + 1):
                    link_arcs.append(LinkArc(i, q, g, h, c))
    return link_arcs


def build_network(
    table: CostTable, num_stages: int | None, upper_s: float | None, layered: bool | None = None,
    deadline: float | None = None,
) -> Network:
    """Enumerate, prune and connect the stage and link arcs (see the module docstring).

    ``layered``: track stages remaining in the states (exact, tight LP) or, when False, in rows
    (one layer: far fewer arcs). None picks layers unless they would exceed LAYERED_ARCS arcs.
    Raises planner.search.deadline.OutOfTime past ``deadline`` (time.perf_counter()).
    """
    if layered is None:
        net = build_network(table, num_stages, upper_s, True, deadline)
        if len(net.stages) <= LAYERED_ARCS or net.cap == 1:
            return net
        return build_network(table, num_stages, upper_s, False, deadline)
    scale = _scale(table, num_stages, upper_s)
    cands = _stage_candidates(table, scale, deadline)
    cap = _capped_state(cands, scale.most_held, table.form.by_position)
    flat = not layered and cap > 1
    if flat:
        cap = 1
    stage_arcs = _stage_arcs(table, scale, cands, cap, flat, deadline)
    group_of, group_rep = _sender_groups(table)
    link_arcs = _link_arcs(table, scale, group_rep, cap, deadline)
    start_states = [min(num_stages, cap)] if num_stages else list(range(1, cap + 1))
    net = Network(scale.unit, cap, start_states, stage_arcs, link_arcs, group_of, _twins(table), flat,
                  scale.most_held, scale.most_stages)
    _prune_unreachable(table, net)
    return net


def head_state(table: CostTable, net: Network, arc: StageArc) -> tuple | None:  # type: ignore[type-arg]
    """The A state a stage arc leads to, or None for the sink."""
    if arc.last == table.num_nodes - 1:
        return None
    q = arc.state if arc.state == net.cap else arc.state - 1
    return ("A", arc.last + 1, q, net.group_of[arc.device])


def tail_state(table: CostTable, net: Network, arc: StageArc) -> tuple | None:  # type: ignore[type-arg]
    """The B state a stage arc leaves from, or None for the source."""
    if arc.first == 0:
        return None
    return ("B", arc.first, arc.state, table.host_of[arc.device])


def _prune_unreachable(table: CostTable, net: Network) -> None:
    """Drop arcs on no source-to-sink path (forward and backward reachability over the DAG)."""
    succ: dict = defaultdict(list)  # type: ignore[type-arg]
    pred: dict = defaultdict(list)  # type: ignore[type-arg]
    edges: list[tuple[object, object]] = []
    for arc in net.stages:
        tail: object = tail_state(table, net, arc)
        if tail is None:
            tail = "S" if arc.state in net.start_states else "X"
        edges.append((tail, head_state(table, net, arc) or "T"))
    for link in net.links:
        edges.append((("A", link.cut, link.state, link.group), ("B", link.cut, link.state, link.host)))
    if net.cap > 1:
        for i in range(1, table.num_nodes):
            for g in set(net.group_of):
                edges.append((("A", i, net.cap, g), ("A", i, net.cap - 1, g)))
    for u, v in edges:
        succ[u].append(v)
        pred[v].append(u)

    def reach(root: object, nxt: dict) -> set:  # type: ignore[type-arg]
        seen, todo = {root}, [root]
        while todo:
            for v in nxt[todo.pop()]:
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        return seen

    fwd, bwd = reach("S", succ), reach("T", pred)
    keep = [u in fwd and v in bwd for u, v in edges]
    ns = len(net.stages)
    net.stages = [a for a, k in zip(net.stages, keep[:ns], strict=True) if k]
    net.links = [a for a, k in zip(net.links, keep[ns : ns + len(net.links)], strict=True) if k]


