"""planner/model/host_symmetry.py: hosts the solvers cannot tell apart, and the replica search that tries one
coordinator per class of them.

Tables here are random dense arrays on 2-3 hosts that each hold the same devices (one or two kinds), linked
alike: every host is interchangeable with every other. Changing one host's RAM, one device, or the link between
two hosts sets them apart (and only as far as the change reaches). On such tables the replica search, summing
the gradients on the first host only, still finds the brute-force optimum over every plan with every coordinator
(tests/unit/test_planner_replicas.py's brute force), and with its multi-host replicas' reductions only bounded
(planner/replica/replica_bound.py CoordinatorShare) it never claims better than that optimum.
"""

from __future__ import annotations

import copy
import random

import pytest
from tables import brute_force_replicas, check_solution

from hetero.planner.model.cost import CostTable
from hetero.planner.model.host_symmetry import interchangeable, representatives
from hetero.planner.replica import replicas
from hetero.planner.replica.replicas import solve_replicas


def symmetric_table(rng: random.Random, hosts: int, per_host: int, schedule: str = "1f1b") -> CostTable:
    """``hosts`` hosts of ``per_host`` devices each, the same kinds on every host; one link cost within a host,
    one between hosts; gradients whose reduction costs a few percent to a third of a step."""
    n = rng.randint(4, 5)
    kinds = []
    for _ in range(rng.randint(1, 2)):
        speed = rng.uniform(0.5, 2.0)
        fwd = [rng.uniform(0.05, 1.0) / speed for _ in range(n)]
        kinds.append({"fwd": fwd, "bwd": [f * rng.uniform(1.5, 3.0) for f in fwd],
                      "weights": [rng.uniform(0.5, 3.0) for _ in range(n)], "lora": [0.05] * n,
                      "acts": [rng.uniform(0.1, 1.5) for _ in range(n)], "usable": rng.uniform(2.0 * n, 3.0 * n)})
    devices = [(h, kinds[k % len(kinds)]) for h in range(hosts) for k in range(per_host)]
    within, across = rng.uniform(0.0, 0.05), rng.uniform(0.1, 0.6)
    links = [[[[within if a == b else across for b in range(hosts)] for a in range(hosts)]] for _ in range(n)]
    near, far = rng.uniform(0.02, 0.1), rng.uniform(0.2, 0.8)
    fwd, bwd, weights, lora, acts = ([[d[key][i] for _, d in devices] for i in range(n)]
                                     for key in ("fwd", "bwd", "weights", "lora", "acts"))
    return CostTable(
        fwd_s=fwd, bwd_s=bwd, weights=weights, lora=lora, activations_per_mb=acts,
        usable_bytes=[d["usable"] for _, d in devices], workspace_bytes=0.0, schedule=schedule,
        num_micro_batches=rng.randint(2, 4), host_of=[h for h, _ in devices], wire_kind=[0] * len(devices),
        link_s=links, grad_bytes=[0.0] + [rng.uniform(0.2, 1.0) for _ in range(n - 1)],
        reduce_s_per_byte=[[near if a == b else far for b in range(hosts)] for a in range(hosts)],
        host_ram_bytes=[64.0] * hosts,
    )


def test_identical_hosts_are_one_class_and_a_change_sets_one_apart() -> None:
    table = symmetric_table(random.Random(1), hosts=3, per_host=2)
    assert representatives(table, [0, 1, 2]) == [0]
    ram = copy.deepcopy(table)
    ram.host_ram_bytes[2] = 32.0
    assert representatives(ram, [0, 1, 2]) == [0, 2]
    device = copy.deepcopy(table)
    device.fwd_s[1][3] *= 1.5  # host 1's second device computes node 1 slower
    assert representatives(device, [0, 1, 2]) == [0, 1]
    # A slow link between hosts 0 and 1 alone: swapping 0 and 1 keeps every link; swapping either with 2 does not.
    link = copy.deepcopy(table)
    for per_node in link.link_s:
        per_node[0][0][1] = per_node[0][1][0] = 2.0
    assert interchangeable(link, 0, 1) and not interchangeable(link, 0, 2) and not interchangeable(link, 1, 2)
    assert representatives(link, [0, 1, 2]) == [0, 2]
    # The reduction's cost to one host alone.
    reduce = copy.deepcopy(table)
    reduce.reduce_s_per_byte[1][2] = reduce.reduce_s_per_byte[2][1] = 5.0
    assert representatives(reduce, [0, 1, 2]) == [0, 1]


@pytest.mark.parametrize("seed", range(6))
def test_one_coordinator_per_class_still_finds_the_optimum(seed: int) -> None:
    rng = random.Random(4000 + seed)
    table = symmetric_table(rng, hosts=2, per_host=2, schedule=("1f1b", "gpipe")[seed % 2])
    assert representatives(table, [0, 1]) == [0]
    sol, best = solve_replicas(table, time_limit_s=60), brute_force_replicas(table)
    assert sol is not None and sol.proven_optimal, sol.message if sol else None
    assert sol.step_time_s == pytest.approx(best, rel=1e-9), sol.message
    check_solution(table, sol)


def test_bounded_reductions_on_identical_hosts_stay_sound(monkeypatch: pytest.MonkeyPatch) -> None:
    # Multi-host replicas not enumerated: CoordinatorShare bounds their reduction. Never better than the optimum,
    # equal to it whenever proven.
    monkeypatch.setattr(replicas, "ENUMERATE_ROWS", 0)
    proven = 0
    for seed in range(6):
        rng = random.Random(5000 + seed)
        table = symmetric_table(rng, hosts=2, per_host=2, schedule=("1f1b", "gpipe")[seed % 2])
        sol, best = solve_replicas(table, time_limit_s=60), brute_force_replicas(table)
        assert sol is not None
        check_solution(table, sol)
        assert sol.step_time_s >= best * (1 - 1e-9)
        if sol.proven_optimal:
            proven += 1
            assert sol.step_time_s == pytest.approx(best, rel=1e-9)
    assert proven
