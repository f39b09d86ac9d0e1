"""Exhaustive search over placements: the reference the solvers are tested against (small problems only).

``brute_force`` ranks by the closed form (objective.pipeline_step_time), what the exact DP and the ILP
minimise; ``brute_force_simulated`` by the simulator's step time, what the plan reports and
planner.search.solve.solve_simulated minimises."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import combinations, permutations, product

from hetero.planner.model.cost import CostTable
from hetero.planner.model.objective import Evaluation, Placement, evaluate
from hetero.planner.search.simsearch import simulated_step_s


def all_placements(num_nodes: int, num_devices: int, num_stages: int | None = None):
    """Every ordered choice of devices with every contiguous split of the nodes among them."""
    counts = [num_stages] if num_stages else range(1, min(num_nodes, num_devices) + 1)
    for s in counts:
        for cuts in combinations(range(1, num_nodes), s - 1):
            bounds = (0, *cuts, num_nodes)
            spans = tuple((bounds[k], bounds[k + 1] - 1) for k in range(s))
            for devices in permutations(range(num_devices), s):
                yield Placement(devices, spans)


def brute_force(table: CostTable, num_stages: int | None = None) -> Evaluation | None:
    """The feasible placement with the lowest closed-form step time, or None when none fits.

    Every recomputation and streaming the table's planner.recompute and planner.offload allow is tried
    explicitly, per stage, as (recompute, stream) pairs (not the planner's rule that the pair of least added
    time that fits is the best), and the hosts' RAM is checked (objective.evaluate).
    """
    best: Evaluation | None = None
    for placement in all_placements(table.num_nodes, table.num_devices, num_stages):
        choices = [list(product(table.recompute_choices(a, b), table.stream_choices(d, a, b)))
                   for d, (a, b) in zip(placement.devices, placement.spans, strict=True)]
        for pairs in product(*choices):
            ev = evaluate(table, Placement(placement.devices, placement.spans, tuple(r for r, _ in pairs),
                                           tuple(s for _, s in pairs)))
            if ev.feasible and (best is None or ev.step_time_s < best.step_time_s):
                best = ev
    return best


def brute_force_simulated(table: CostTable, num_stages: int | None = None, every_recompute: bool = True,
                          placements: Iterable[Placement] | None = None) -> tuple[Evaluation, float] | None:
    """The feasible placement with the lowest simulated step time and that time, or None when none fits.

    ``every_recompute``: try every recomputation and streaming planner.recompute and planner.offload allow per
    stage (else objective.evaluate's rule); ``placements``: search only these (default: all).
    """
    best: tuple[Evaluation, float] | None = None
    for placement in placements if placements is not None else all_placements(table.num_nodes, table.num_devices,
                                                                               num_stages):
        choices = [list(product(table.recompute_choices(a, b), table.stream_choices(d, a, b))) if every_recompute
                   else [None] for d, (a, b) in zip(placement.devices, placement.spans, strict=True)]
        for pairs in product(*choices):
            rec = None if pairs[0] is None else tuple(int(p[0]) for p in pairs if p is not None)
            stream = None if pairs[0] is None else tuple(int(p[1]) for p in pairs if p is not None)
            ev = evaluate(table, Placement(placement.devices, placement.spans, rec, stream))
            if not ev.feasible:
                continue
            step = simulated_step_s(table, ev)
            if best is None or step < best[1]:
                best = (ev, step)
    return best
