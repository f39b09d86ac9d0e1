"""Support for the planner tests (helpers, not tests): random dense cost tables as the solvers see them, the
brute-force replica search and its checks."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator

import pytest

from hetero.planner.model.cost import CostTable, subtable
from hetero.planner.model.objective import Evaluation, Placement, evaluate
from hetero.planner.replica.replicas import ReplicaSolution
from hetero.planner.search.bruteforce import all_placements


def random_table(rng: random.Random, max_devices: int = 4, max_nodes: int = 6, schedule: str | None = None,
                 mode: str | None = None) -> CostTable:
    """Devices of 1-3 random kinds (1-3 identical copies each), 1-3 hosts, 1-2 wire kinds; memory
    between "nothing fits" and "everything fits on one device"; some layers recomputable."""
    n = rng.randint(2, max_nodes)
    kinds = []
    for _ in range(rng.randint(1, 3)):
        speed = rng.uniform(0.2, 3.0)
        fwd = [rng.uniform(0.05, 1.0) / speed for _ in range(n)]
        kinds.append({
            "fwd": fwd, "bwd": [f * rng.uniform(1.5, 3.0) for f in fwd],
            "weights": [rng.uniform(0.5, 3.0) for _ in range(n)], "lora": [rng.uniform(0.0, 0.2) for _ in range(n)],
            "acts": [rng.uniform(0.1, 1.5) for _ in range(n)], "wire": rng.randrange(2),
            "usable": rng.uniform(2.0, 4.0 * n), "host": rng.randrange(3), "copies": rng.choice([1, 1, 2, 3]),
        })
    devices = [k for k in kinds for _ in range(k["copies"])][:max_devices]
    hosts = max(d["host"] for d in devices) + 1
    recomputable = [0 < i < n - 1 and rng.random() < 0.7 for i in range(n)]
    keep = [rng.uniform(0.05, 0.5) for _ in range(n)]
    links = []
    for _ in range(n):
        per_kind = []
        for _ in range(2):
            base = rng.uniform(0.0, 0.4)
            per_kind.append([[rng.uniform(0.0, 0.05) if a == b else base + rng.uniform(0.0, 0.3) for b in range(hosts)]
                             for a in range(hosts)])
        links.append(per_kind)
    fwd, bwd, weights, lora, acts = ([[d[key][i] for d in devices] for i in range(n)]
                                     for key in ("fwd", "bwd", "weights", "lora", "acts"))
    return CostTable(
        fwd_s=fwd, bwd_s=bwd, weights=weights, lora=lora, activations_per_mb=acts,
        usable_bytes=[d["usable"] for d in devices], workspace_bytes=rng.choice([0.0, 0.3]),
        schedule=schedule or rng.choice(["1f1b", "1f1b", "gpipe"]), num_micro_batches=rng.choice([1, 2, 3, 4, 8]),
        host_of=[d["host"] for d in devices], wire_kind=[d["wire"] for d in devices], link_s=links,
        recompute_per_mb=[[a * keep[i] if recomputable[i] else a for a in acts[i]] for i in range(n)],
        recompute_s=[[f if recomputable[i] else 0.0 for f in fwd[i]] for i in range(n)],
        recomputable=recomputable, recompute_mode=mode or rng.choice(["auto", "auto", "none", "full"]),
    )


def replica_table(rng: random.Random, schedule: str, mode: str) -> CostTable:
    """3-4 devices of 2-3 kinds (the first kind twice) on two hosts, 4-5 nodes, M = 2..4, gradients
    whose reduction costs a few percent to a third of a step, cheaper within a host."""
    n = rng.randint(4, 5)
    kinds = []
    for k in range(rng.randint(2, 3)):
        speed = rng.uniform(0.3, 3.0)
        fwd = [rng.uniform(0.05, 1.0) / speed for _ in range(n)]
        kinds.append({"fwd": fwd, "bwd": [f * rng.uniform(1.5, 3.0) for f in fwd],
                      "weights": [rng.uniform(0.5, 3.0) for _ in range(n)],
                      "lora": [rng.uniform(0.0, 0.2) for _ in range(n)],
                      "acts": [rng.uniform(0.1, 1.5) for _ in range(n)], "wire": rng.randrange(2),
                      "usable": rng.uniform(3.0, 3.0 * n), "host": k % 2, "copies": 2 if k == 0 else 1})
    devices = [k for k in kinds for _ in range(k["copies"])][:4]
    recomputable = [0 < i < n - 1 and rng.random() < 0.7 for i in range(n)]
    keep = [rng.uniform(0.05, 0.5) for _ in range(n)]
    links = [[[[rng.uniform(0.0, 0.05) if a == b else rng.uniform(0.1, 0.6) for b in range(2)] for a in range(2)]
              for _ in range(2)] for _ in range(n)]
    fwd, bwd, weights, lora, acts = ([[d[key][i] for d in devices] for i in range(n)]
                                     for key in ("fwd", "bwd", "weights", "lora", "acts"))
    return CostTable(
        fwd_s=fwd, bwd_s=bwd, weights=weights, lora=lora, activations_per_mb=acts,
        usable_bytes=[d["usable"] for d in devices], workspace_bytes=rng.choice([0.0, 0.3]),
        schedule=schedule, num_micro_batches=rng.randint(2, 4),
        host_of=[d["host"] for d in devices], wire_kind=[d["wire"] for d in devices], link_s=links,
        recompute_per_mb=[[a * keep[i] if recomputable[i] else a for a in acts[i]] for i in range(n)],
        recompute_s=[[f if recomputable[i] else 0.0 for f in fwd[i]] for i in range(n)],
        recomputable=recomputable, recompute_mode=mode,
        grad_bytes=[0.0] + [rng.uniform(0.0, 1.0) for _ in range(n - 1)],
        reduce_s_per_byte=[[rng.uniform(0.02, 0.2) if a == b else rng.uniform(0.2, 0.8) for b in range(2)]
                           for a in range(2)],
    )


def fastest_evaluations(table: CostTable) -> tuple[list[Placement], dict[tuple[Placement, int], Evaluation | None]]:
    """Every placement, and per (placement, share of m micro-batches) its fastest feasible evaluation over every
    recomputation by the closed form (None when none fits)."""
    M = table.num_micro_batches
    subs = {m: subtable(table, m) for m in range(1, M + 1)}
    fastest: dict[tuple[Placement, int], Evaluation | None] = {}
    placements = list(all_placements(table.num_nodes, table.num_devices))
    for p in placements:
        for m, sub in subs.items():
            evs = [ev for rec in itertools.product(*(sub.recompute_choices(a, b) for a, b in p.spans))
                   if (ev := evaluate(sub, Placement(p.devices, p.spans, rec))).feasible]
            fastest[(p, m)] = min(evs, key=lambda e: e.step_time_s, default=None)
    return placements, fastest


def brute_force_replicas(table: CostTable) -> float:
    """The least step time over every replica plan (inf when nothing fits)."""
    M = table.num_micro_batches
    placements, evaluations = fastest_evaluations(table)
    fastest = {key: ev.step_time_s if ev is not None else float("inf") for key, ev in evaluations.items()}
    best = min(fastest[(p, M)] for p in placements)
    for chosen, shares, red in replica_plans(table, placements, M):
        best = min(best, max(fastest[(p, m)] for p, m in zip(chosen, shares, strict=True)) + red)
    return best


def check_solution(table: CostTable, sol: ReplicaSolution) -> None:
    """Disjoint replicas covering every node, shares summing to M, each evaluated (feasibly) at its own
    share, and the step time = max T + the reduction."""
    used = [d for p in sol.placements for d in p.devices]
    assert len(used) == len(set(used))
    assert sum(sol.shares) == table.num_micro_batches and min(sol.shares) >= 1
    for p, m, ev in zip(sol.placements, sol.shares, sol.evaluations, strict=True):
        assert p.spans[0][0] == 0 and p.spans[-1][1] == table.num_nodes - 1
        assert all(a[1] + 1 == b[0] for a, b in zip(p.spans, p.spans[1:], strict=False))
        again = evaluate(subtable(table, m), p)
        assert ev.feasible and again.feasible
        assert again.step_time_s == ev.step_time_s and again.memory == ev.memory
    red = reduction(table, sol.placements) if len(sol.placements) > 1 else 0.0
    assert sol.reduce_s == pytest.approx(red, rel=1e-12, abs=1e-12)
    assert sol.step_time_s == pytest.approx(max(e.step_time_s for e in sol.evaluations) + red, rel=1e-12)


def with_overheads(rng: random.Random, table: CostTable) -> CostTable:
    """The table with message costs per cut and device, sync round trips and optimizer steps (all random)."""
    n, nd = table.num_nodes, table.num_devices
    kinds, hosts = max(table.wire_kind) + 1, max(table.host_of) + 1
    scale = rng.choice([0.0, 0.02, 0.1])
    return dataclasses.replace(
        table,
        message_send_s=[[[rng.uniform(0, scale) for _ in range(nd)] for _ in range(kinds)] for _ in range(n)],
        message_recv_s=[[[rng.uniform(0, scale) for _ in range(nd)] for _ in range(kinds)] for _ in range(n)],
        sync_round_trip_s=[[rng.uniform(0, scale) for _ in range(hosts)] for _ in range(hosts)],
        opt_s=[[rng.uniform(0, scale) for _ in range(nd)] for _ in range(n)],
        opt_fixed_s=[rng.uniform(0, scale) for _ in range(nd)], _prefix={}, _classes=[])


def reduction(table: CostTable, replicas: list[Placement]) -> float:
    """Every stage's gradient bytes to the coordinator (host of replica 0's first device) and back."""
    home = table.host_of[replicas[0].devices[0]]
    return sum(table.grad_bytes[i] * table.reduce_s_per_byte[table.host_of[d]][home]
               for p in replicas for d, (a, b) in zip(p.devices, p.spans, strict=True) for i in range(a, b + 1))


def replica_plans(table: CostTable, placements: list[Placement], max_replicas: int,
                  ) -> Iterator[tuple[list[Placement], list[int], float]]:
    """Every plan of 2..max_replicas replicas on disjoint devices: (placements, shares, gradient reduction)."""
    M = table.num_micro_batches

    def extend(chosen: list[Placement], used: set[int]) -> Iterator[tuple[list[Placement], list[int], float]]:
        if len(chosen) >= 2:
            red = reduction(table, chosen)
            for cuts in itertools.combinations(range(1, M), len(chosen) - 1):
                yield chosen, [b - a for a, b in zip((0, *cuts), (*cuts, M), strict=True)], red
        if len(chosen) < max_replicas:
            for p in placements:
                if used.isdisjoint(p.devices):
                    yield from extend(chosen + [p], used | set(p.devices))

    yield from extend([], set())
