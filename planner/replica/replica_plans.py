"""A plan of data x pipeline replicas as the replica search (planner/replica/replicas.py) prices it: each replica evaluated
with its own share of the micro-batches, the gradient reduction through the coordinator, the step; and mirrored
replicas, the candidates of fleets too large for the exact search."""

from __future__ import annotations

from hetero.planner.model.cost import CostTable, subtable
from hetero.planner.model.objective import Evaluation, Placement, evaluate
from hetero.planner.search.deadline import left
from hetero.planner.search.solve import solve


def reduce_time_s(table: CostTable, placements: list[Placement]) -> float:
    """The step's gradient reduction through the coordinator on replica 0's first host (0 for one replica)."""
    if len(placements) < 2:
        return 0.0
    coordinator = table.host_of[placements[0].devices[0]]
    total = 0.0
    for placement in placements:
        for d, (first, last) in zip(placement.devices, placement.spans, strict=True):
            total += sum(table.grad_bytes[first:last + 1]) * table.reduce_s_per_byte[table.host_of[d]][coordinator]
    return total


def evaluate_replicas(table: CostTable, placements: list[Placement], shares: list[int],
                      ) -> tuple[list[Evaluation], float, float]:
    """Each replica evaluated with its own share, the reduction, and the step time (max + reduction)."""
    if len(placements) != len(shares) or not placements or min(shares) < 1:
        raise ValueError("one share >= 1 per replica")
    if sum(shares) != table.num_micro_batches:
        raise ValueError(f"the shares sum to {sum(shares)}, not the step's {table.num_micro_batches} micro-batches")
    used = [d for p in placements for d in p.devices]
    if len(set(used)) != len(used):
        raise ValueError("replicas share a device")
    evaluations = [evaluate(subtable(table, m), p) for p, m in zip(placements, shares, strict=True)]
    reduce_s = reduce_time_s(table, placements)
    return evaluations, reduce_s, max(e.step_time_s for e in evaluations) + reduce_s


def mirrored(table: CostTable, limit: int, num_stages: int | None, deadline: float,
              exact_count: bool) -> tuple[list[Placement], list[int]] | None:
    """The fastest plan of R mirrored replicas (each class's devices dealt round-robin, shares as even as
    they go) over R = 2..limit (exactly ``limit`` with ``exact_count``), each replica's pipeline solved on
    its own devices; None when none fits in time. For fleets too large for the exact search."""
    classes = table.device_classes()
    order = sorted(range(table.num_devices), key=lambda d: (classes[d], d))
    best: tuple[float, list[Placement], list[int]] | None = None
    for r in range(limit if exact_count else 2, limit + 1):
        groups = [order[k::r] for k in range(r)]  # devices of a class sit together: dealt round-robin
        shares = [table.num_micro_batches // r + (k < table.num_micro_batches % r) for k in range(r)]
        placements: list[Placement] = []
        for devices, m in zip(groups, shares, strict=True):
            if left(deadline) <= 0:
                return None if best is None else (best[1], best[2])
            found = solve(subtable(table, m, devices), num_stages, left(deadline)).evaluation
            if found is None:
                break
            placements.append(Placement(tuple(devices[i] for i in found.placement.devices), found.placement.spans))
        if len(placements) < r:
            continue
        evaluations, _, step = evaluate_replicas(table, placements, shares)
        if all(e.feasible for e in evaluations) and (best is None or step < best[0]):
            best = (step, placements, shares)
    return None if best is None else (best[1], best[2])
