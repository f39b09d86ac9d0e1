"""Exhaustive search over placements: the reference the ILP is tested against (small problems only)."""

from __future__ import annotations

from itertools import combinations, permutations, product

from hetero.planner.cost import CostTable
from hetero.planner.objective import Evaluation, Placement, evaluate


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

    Every recomputation the table's planner.recompute allows is tried explicitly, per stage (not the
    planner's rule that the fewest recomputing layers that fit are the fastest).
    """
    best: Evaluation | None = None
    for placement in all_placements(table.num_nodes, table.num_devices, num_stages):
        choices = [table.recompute_choices(a, b) for a, b in placement.spans]
        for recompute in product(*choices):
            ev = evaluate(table, Placement(placement.devices, placement.spans, tuple(recompute)))
            if ev.feasible and (best is None or ev.step_time_s < best.step_time_s):
                best = ev
    return best
