"""planner/replica/replica_bound.py: the replica search's lower bounds on T(U, m) hold against brute force.

On random small tables (tests/unit/test_planner_replicas.py's generator: 2-3 device kinds on two hosts, both
schedules, every recomputation mode) every multiset U of device classes and share m is checked against the
fastest placement on U's devices found by enumerating every placement and recomputation:

- lb[U][m] <= T(U, m) (inf exactly where nothing fits);
- the period bound is what the search's propagation needs: T(V, m') >= T(U, m) + (m' - m) period[V] for V <= U;
- the bound is never looser than the one it replaced (least work + (m - 1) x max(least work / |U|, largest
  layer)), and strictly tighter on some tables (hand-offs, slower devices, memory).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from tables import fastest_evaluations, replica_table

from hetero.planner.model.cost import CostTable
from hetero.planner.replica.replica_bound import replica_bounds
from hetero.planner.replica.replica_packing import ClassMultisets

INF = float("inf")


def brute_force_t(table: CostTable, sets: ClassMultisets) -> np.ndarray:
    """T[u][m]: the fastest closed-form placement whose devices' classes fit in multiset u (inf: none fits)."""
    placements, fastest = fastest_evaluations(table)
    t = np.full((len(sets.multisets), table.num_micro_batches + 1), INF)
    for p in placements:
        used = np.bincount([sets.classes[d] for d in p.devices], minlength=len(sets.members))
        for u, counts in enumerate(sets.multisets):
            if (used <= np.array(counts)).all():
                for m in range(1, table.num_micro_batches + 1):
                    ev = fastest[(p, m)]
                    if ev is not None:
                        t[u, m] = min(t[u, m], ev.step_time_s)
    return t


def earlier_bound(table: CostTable, sets: ClassMultisets) -> np.ndarray:
    """The bound planner/replica/replicas.py used before: least work W + (m - 1) max(W / |U|, the largest layer)."""
    reps = [mem[0] for mem in sets.members]
    work = np.array([[table.fwd_s[i][d] + table.bwd_s[i][d] for d in reps] for i in range(table.num_nodes)])
    need = np.array([[table.weights[i][d] + table.lora[i][d] for d in reps] for i in range(table.num_nodes)])
    room = np.array([max(0.0, table.usable_bytes[d] - table.workspace_bytes) for d in reps])
    lb = np.full((len(sets.multisets), table.num_micro_batches + 1), INF)
    for u in range(1, len(sets.multisets)):
        counts = np.array(sets.multisets[u])
        mask = counts > 0
        least = work[:, mask].min(axis=1)
        if need[:, mask].min(axis=1).sum() <= float(counts @ room):
            lb[u, 1:] = least.sum() + np.arange(table.num_micro_batches) * max(least.sum() / counts.sum(), least.max())
    return lb


@pytest.mark.parametrize("chunk", range(3))
def test_the_bounds_hold_against_brute_force_and_only_tighten(chunk: int) -> None:
    tighter = 0
    for seed in range(chunk * 8, (chunk + 1) * 8):
        rng = random.Random(1000 + seed)
        table = replica_table(rng, ("1f1b", "gpipe")[seed % 2], rng.choice(["auto", "none", "full"]))
        sets = ClassMultisets.of(table)
        lb, period = replica_bounds(table, sets, float("inf"))
        truth, before = brute_force_t(table, sets), earlier_bound(table, sets)
        M = table.num_micro_batches
        for u in range(1, len(sets.multisets)):
            assert np.isfinite(period[u]), (seed, u)
            for m in range(1, M + 1):
                where = f"seed {seed}, U={sets.multisets[u]}, m={m}"
                assert lb[u, m] <= truth[u, m] * (1 + 1e-9), where
                assert lb[u, m] >= before[u, m] * (1 - 1e-9) or not np.isfinite(before[u, m]), where
                tighter += bool(np.isfinite(truth[u, m]) and lb[u, m] > before[u, m] * (1 + 1e-6))
                # What the search's record() propagates from a solve of U at m to every V <= U at m' >= m.
                for v in sets.subsets[u]:
                    for later in range(m, M + 1):
                        if np.isfinite(truth[v, later]):
                            assert truth[v, later] >= (truth[u, m] + (later - m) * period[v]) * (1 - 1e-9), where
    assert tighter > 0, "the tables exercised no case where the bound is tighter than the one it replaced"


@pytest.mark.parametrize("chunk", range(2))
def test_the_reduction_bound_holds_against_every_placement(chunk: int) -> None:
    # CoordinatorShare: a replica's devices on the coordinator's host compute each of the m micro-batches within
    # its T, so they carry at most so many gradient bytes; every other byte pays another host's cost. Checked for
    # every placement, every share, every coordinator and every multiset holding its devices (a replica may leave
    # some idle), at the fastest T the placement reaches (the bound only falls as T rises).
    from hetero.planner.replica.replica_bound import CoordinatorShare

    tighter = 0
    for seed in range(chunk * 6, (chunk + 1) * 6):
        rng = random.Random(2000 + seed)
        table = replica_table(rng, ("1f1b", "gpipe")[seed % 2], rng.choice(["auto", "none", "full"]))
        sets = ClassMultisets.of(table)
        share = CoordinatorShare(table, sets)
        cost, grad = table.reduce_s_per_byte, table.grad_bytes
        placements, fastest = fastest_evaluations(table)
        for p in placements:
            used = np.bincount([sets.classes[d] for d in p.devices], minlength=len(sets.members))
            holders = [u for u, counts in enumerate(sets.multisets) if (used <= np.array(counts)).all()]
            for m in range(1, table.num_micro_batches + 1):
                if (ev := fastest[(p, m)]) is None:
                    continue
                for h in range(len(cost)):
                    red = sum(grad[i] * cost[table.host_of[d]][h]
                              for d, (a, b) in zip(p.devices, p.spans, strict=True) for i in range(a, b + 1))
                    for u in holders:
                        bound = share.reduction(u, h, ev.step_time_s, m)
                        where = f"seed {seed}, {p}, m={m}, coordinator {h}, U={sets.multisets[u]}"
                        assert bound <= red * (1 + 1e-9) + 1e-12, where
                        cheapest = sum(grad) * min(cost[x][h] for x in sets.hosts_of[u])
                        assert bound >= cheapest * (1 - 1e-9), where
                        tighter += bound > cheapest * (1 + 1e-6)
    assert tighter > 0, "no case where the coupled bound beats the cheapest host's"
