"""planner/replica/replica_packing.py: the packing DP done with one array operation per multiset equals the memoized one.

The replica search (planner/replica/replicas.py) packs disjoint replicas whose shares sum to the step's micro-batches
into the least total reduction, at every threshold of its sweep. Where reductions vary with the share (replicas
over several hosts, bounded by planner/replica/replica_bound.py CoordinatorShare) it uses ``_Arrays``; elsewhere, and
where the replicas are counted, the memoized ``_Packing``. On random tables, every threshold, coordinator and
relaxation, both give the same least reduction, and the packing ``_Arrays`` walks back is disjoint, sums to the
step's micro-batches, holds the coordinator's replica where it must and reaches that reduction.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from tables import replica_table

from hetero.planner.replica.replica_packing import _Arrays, _Packing
from hetero.planner.replica.replicas import _Search

INF = float("inf")


@pytest.mark.parametrize("seed", range(6))
def test_array_packing_equals_the_memoized_one(seed: int) -> None:
    rng = random.Random(3000 + seed)
    table = replica_table(rng, ("1f1b", "gpipe")[seed % 2], rng.choice(["auto", "none"]))
    search = _Search(table, time.perf_counter() + 60, None)
    sets, total = search.sets, table.num_micro_batches
    values = sorted({float(v) for v in search.lb[1:, 1:].ravel() if np.isfinite(v)})
    compared = packed = 0
    for tau in values[:: max(1, len(values) // 12)] + [INF]:
        for hi in range(len(search.coordinators)):
            opts = search.options(tau, hi, lower=True)
            for need in (False, True):
                memo = _Packing(sets, opts, False, time.perf_counter() + 60)
                want = memo.g(sets.full, total, need, None)
                arrays = _Arrays(sets, opts, total, need, time.perf_counter() + 60)
                got = float(arrays.g[sets.full, total, int(need)])
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (seed, tau, hi, need)
                compared += 1
                if got == INF:
                    continue
                slowest, picked = arrays.walk(sets.full, total, need)
                counts = np.sum([sets.multisets[u] for u, *_ in picked], axis=0)
                assert (counts <= np.array(sets.multisets[sets.full])).all()
                assert sum(m for _, m, _, _ in picked) == total
                assert not need or sum(lead for *_, lead in picked) == 1
                entry = {(u, m): e for u, (_, es) in opts.items() for e in es for m in [e[0]]}
                reached = sum(entry[(u, m)][2 if lead else 1] for u, m, _, lead in picked)
                assert reached == pytest.approx(got, rel=1e-12, abs=1e-12)
                assert slowest == max(entry[(u, m)][6 if lead else 5] for u, m, _, lead in picked)
                packed += 1
    assert compared and packed
