"""The placement ILP against exhaustive search, on random small fleets and graphs."""

from __future__ import annotations

import random

import pytest
from fleets import make_cluster, make_graph, table_for

from hetero.planner.explain.baselines import candidate_placements
from hetero.planner.model.objective import Placement, evaluate
from hetero.planner.search.bruteforce import brute_force
from hetero.planner.search.ilp import _Model, solve_ilp
from hetero.planner.search.network import build_network, canonical
from hetero.planner.search.splits import dp_starts


def random_problem(rng: random.Random):  # type: ignore[no-untyped-def]
    """2-4 devices on 1-3 hosts (some identical, some tight), a 4-9 node graph."""
    n_dev = rng.randint(2, 4)
    n_hosts = rng.randint(1, 3)
    spec = []
    for _ in range(n_dev):
        kind = rng.choice(["rtx3090", "rtx4090", "v100", "m40"])
        mem = None if rng.random() < 0.5 else rng.choice([2.0, 3.0, 4.0, 6.0, 10.0])
        spec.append((f"h{rng.randrange(n_hosts)}", kind, mem))
    if rng.random() < 0.4:  # an identical twin of the first device
        spec.append(spec[0])
        spec = spec[:4]
    cluster = make_cluster(spec, gbps=rng.choice([1.0, 10.0, 100.0]))
    graph = make_graph(rng.randint(2, 7), hidden=rng.choice([1024, 2048, 4096]), rng=rng)
    return cluster, graph


def twin_problem(rng: random.Random):  # type: ignore[no-untyped-def]
    """3-5 devices in (near-)twin groups (same type and host), often tight memory, a 4-8 node graph."""
    spec: list[tuple[str, str, float | None]] = []
    while len(spec) < rng.randint(3, 5):
        kind = rng.choice(["rtx3090", "rtx4090", "v100", "m40"])
        mem = rng.choice([None, 2.0, 3.0, 4.0])
        host = f"h{rng.randrange(2)}"
        for _ in range(rng.randint(1, 3)):
            # Now and then a near-twin: same type and host, other memory (not interchangeable).
            spec.append((host, kind, mem if rng.random() < 0.7 else rng.choice([3.0, 6.0, None])))
    cluster = make_cluster(spec[:5], gbps=rng.choice([1.0, 10.0]))
    graph = make_graph(rng.randint(2, 6), hidden=rng.choice([2048, 4096]), rng=rng)
    return cluster, graph


def check_against_brute_force(rng: random.Random, cluster, graph, split_dp: bool,  # type: ignore[no-untyped-def]
                              layered: bool | None = None) -> None:
    """The ILP's placement and objective equal the exhaustive optimum (or both say infeasible)."""
    schedule = rng.choice(["1f1b", "gpipe"])
    table, _, _ = table_for(graph, cluster, schedule=schedule, m=rng.choice([1, 2, 4, 8]),
                            quantization=rng.choice(["none", "nf4"]))
    forced = rng.choice([None, None, 1, 2, 3])
    if forced and forced > min(len(cluster.devices), len(graph.nodes)):
        forced = None
    best = brute_force(table, forced)
    result = solve_ilp(table, forced, time_limit_s=30, split_dp=split_dp, layered=layered)
    if best is None:
        assert result.evaluation is None, "ILP found a placement the brute force says cannot fit"
        assert result.report.sol_status == "No Solution Exists"
        return
    assert result.evaluation is not None, result.report
    assert result.report.proven_optimal
    assert result.evaluation.feasible
    if forced:
        assert len(result.evaluation.placement.devices) == forced
    assert result.evaluation.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
    assert result.report.objective_s == pytest.approx(best.step_time_s, rel=1e-6)


@pytest.mark.parametrize("seed", range(30))
def test_ilp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    cluster, graph = random_problem(rng)
    check_against_brute_force(rng, cluster, graph, split_dp=True)


@pytest.mark.parametrize("seed", range(100, 120))
def test_ilp_alone_matches_brute_force(seed: int) -> None:
    # Without the split DP's upper bound nothing is pruned by cost: the network and CBC alone.
    rng = random.Random(seed)
    cluster, graph = random_problem(rng)
    check_against_brute_force(rng, cluster, graph, split_dp=False)


@pytest.mark.parametrize("seed", range(200, 230))
def test_ilp_matches_brute_force_with_twins(seed: int) -> None:
    rng = random.Random(seed)
    cluster, graph = twin_problem(rng)
    # Both ways of tracking the micro-batches in flight: layered states, or rows on a flat network.
    check_against_brute_force(rng, cluster, graph, split_dp=seed % 2 == 0, layered=seed % 3 != 0)


@pytest.mark.parametrize("seed", range(16))
def test_in_flight_memory_matches_brute_force(seed: int) -> None:
    # Activation-heavy layers on 2-4 GB cards: where a stage sits (how many micro-batches it holds
    # under 1F1B) decides what fits, so ignoring in-flight memory gives wrong answers here.
    rng = random.Random(seed)
    spec = [(f"h{rng.randrange(2)}", rng.choice(["rtx4090", "rtx3090", "v100"]), rng.choice([2.0, 2.5, 3.0, 4.0]))
            for _ in range(rng.randint(2, 4))]
    graph = make_graph(rng.randint(3, 6), hidden=4096, rng=random.Random(seed))
    table, _, _ = table_for(graph, make_cluster(spec), m=8, quantization="nf4")
    ilp_matches_brute_force(table, None, split_dp=seed % 2 == 0)


def ilp_matches_brute_force(table, forced: int | None, split_dp: bool) -> list:
    """The layered and the flat ILP both reach the brute-force optimum, or both find nothing; their evaluations."""
    best = brute_force(table, forced)
    found = []
    for layered in (True, False):
        result = solve_ilp(table, forced, time_limit_s=30, split_dp=split_dp, layered=layered)
        if best is None:
            assert result.evaluation is None
            continue
        assert result.report.proven_optimal and result.evaluation is not None and result.evaluation.feasible
        assert result.evaluation.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)
        found.append(result.evaluation)
    return found


@pytest.mark.parametrize("seed", range(300, 336))
def test_recompute_choice_matches_brute_force(seed: int) -> None:
    # Activation-heavy layers on small cards with recomputation allowed: the brute force tries every
    # per-stage recompute count explicitly; the ILP must find the same optimum (layered and flat).
    rng = random.Random(seed)
    spec = [(f"h{rng.randrange(2)}", rng.choice(["rtx4090", "rtx3090", "v100"]), rng.choice([1.5, 2.0, 2.5, 3.0, 4.0]))
            for _ in range(rng.randint(2, 4))]
    graph = make_graph(rng.randint(2, 6), hidden=4096, rng=random.Random(seed), recompute=True)
    mode = ["auto", "auto", "full", "none"][seed % 4]
    table, _, _ = table_for(graph, make_cluster(spec), schedule=rng.choice(["1f1b", "1f1b", "gpipe"]),
                            m=rng.choice([2, 4, 8]), quantization="nf4", recompute=mode)
    forced = rng.choice([None, None, 2])
    for evaluation in ilp_matches_brute_force(table, forced, split_dp=seed % 2 == 0):
        if mode == "none":
            assert not any(evaluation.recompute)


def test_recompute_is_chosen_only_where_memory_needs_it() -> None:
    # Roomy cards: nothing recomputes. Small ones: auto recomputes some layers and fits where none fails.
    graph = make_graph(6, hidden=4096, rng=random.Random(1), recompute=True)
    roomy, _, _ = table_for(graph, make_cluster([("a", "rtx4090", None), ("a", "rtx3090", None)]), m=8,
                            quantization="nf4")
    result = solve_ilp(roomy, None, time_limit_s=30)
    assert result.evaluation is not None and not any(result.evaluation.recompute)
    cluster = make_cluster([("a", "rtx4090", 2.5), ("a", "rtx3090", 2.5)])
    tight, _, _ = table_for(graph, cluster, m=8, quantization="nf4")
    none, _, _ = table_for(graph, cluster, m=8, quantization="nf4", recompute="none")
    full, _, _ = table_for(graph, cluster, m=8, quantization="nf4", recompute="full")
    assert brute_force(none) is None
    auto_ev, full_ev = solve_ilp(tight, None, 30).evaluation, solve_ilp(full, None, 30).evaluation
    assert auto_ev is not None and full_ev is not None
    assert 0 < sum(auto_ev.recompute) < len(graph.decoder_indices())
    assert auto_ev.step_time_s < full_ev.step_time_s  # recomputing fewer layers is faster
    # The extra backward time is one more forward of each recomputing layer.
    for k, (d, (a, b)) in enumerate(zip(full_ev.placement.devices, full_ev.placement.spans, strict=True)):
        layers = [i for i in range(a, b + 1) if full.recomputable[i]]
        assert full_ev.recompute[k] == len(layers)
        assert full_ev.recompute_s[k] == pytest.approx(sum(full.fwd_s[i][d] for i in layers))


def test_in_flight_memory_is_exact() -> None:
    # Under 1F1B the first of S stages holds S micro-batches: the small cards only fit late in the
    # pipeline. The network needs its capped state (> 1) and must still match brute force.
    cluster = make_cluster([("a", "rtx4090", 3.0), ("a", "rtx3090", 3.0), ("a", "v100", 3.0), ("b", "rtx3090", 8.0)])
    graph = make_graph(6, hidden=2048, rng=random.Random(5))
    table, _, _ = table_for(graph, cluster, m=8, quantization="nf4")
    assert build_network(table, None, None).cap > 1
    assert build_network(table, None, None, layered=False).flat
    for forced in (None, 2, 3, 4):
        best = brute_force(table, forced)
        assert best is not None
        for split_dp, layered in ((True, True), (False, True), (False, False)):
            result = solve_ilp(table, forced, time_limit_s=30, split_dp=split_dp, layered=layered)
            assert result.report.proven_optimal and result.evaluation is not None
            assert result.evaluation.step_time_s == pytest.approx(best.step_time_s, rel=1e-6)


def test_mip_start_satisfies_every_constraint() -> None:
    # CBC silently drops an inconsistent MIP start; check ours (twins reordered, capped states).
    problems = [twin_problem(random.Random(seed)) for seed in range(300, 306)]
    problems.append((make_cluster([("a", "rtx4090", 3.0), ("a", "rtx3090", 3.0), ("a", "rtx3090", 3.0),
                                   ("b", "rtx3090", 8.0)]), make_graph(6, hidden=2048, rng=random.Random(5))))
    checked = 0
    for cluster, graph in problems:
        table, _, _ = table_for(graph, cluster, m=8, quantization="nf4")
        for start in dp_starts(table)[:3]:
            net = build_network(table, None, start.step_time_s, layered=checked % 2 == 0)
            model = _Model(table, net, None)
            # Reverse every twin group (same costs) so the start is rarely in canonical order already.
            groups: list[list[int]] = []
            for a, b in net.twins:
                group = next((g for g in groups if a in g), None)
                if group is None:
                    groups.append([a, b])
                else:
                    group.append(b)
            swap = {d: r for g in groups for d, r in zip(g, reversed(g), strict=True)}
            devices = tuple(swap.get(d, d) for d in start.placement.devices)
            placement = canonical(Placement(devices, start.placement.spans), net.twins)
            assert evaluate(table, placement).step_time_s == pytest.approx(start.step_time_s, rel=1e-12)
            assert model.warm_start(evaluate(table, placement))
            assert all(c.valid(1e-9) for c in model.prob.constraints.values())
            assert model.prob.objective.value() * net.unit == pytest.approx(start.step_time_s, rel=1e-9)
            checked += 1
    assert checked >= 10


def test_split_dp_gives_feasible_upper_bounds() -> None:
    for seed in range(10):
        rng = random.Random(seed)
        cluster, graph = random_problem(rng)
        table, _, _ = table_for(graph, cluster, m=4, quantization="nf4")
        best = brute_force(table)
        found = dp_starts(table)
        assert all(ev.feasible for ev in found)
        if best is None:
            assert not found
        else:
            assert found and found[0].step_time_s >= best.step_time_s * (1 - 1e-9)


FLEETS = {
    # mixed_fleet: 3090 + 4090 in one box, a V100 16 GB and an M40 on 1 GbE (4 devices, 3 hosts).
    "mixed": ([("gamer", "rtx3090", None), ("gamer", "rtx4090", None), ("volta", "v100", None),
               ("maxwell", "m40", None)], 1.0),
    # mining_rig: 4x 3090 + 2x smaller cards in one host (two twin groups).
    "rig": ([("rig", "rtx3090", None)] * 4 + [("rig", "rtx3090", 10.0)] * 2, 8.0),
}


@pytest.mark.parametrize(("fleet", "quantization", "split_dp"),
                         [("mixed", "none", True), ("mixed", "nf4", False), ("rig", "nf4", True)])
def test_llama8b_shaped_fleets_prove_optimal(fleet: str, quantization: str, split_dp: bool) -> None:
    # 35 nodes (embedding, 33 decoders, head): the ILP must prove optimality, not time out.
    spec, gbps = FLEETS[fleet]
    graph = make_graph(33, 4096, rng=random.Random(1))
    table, _, _ = table_for(graph, make_cluster(spec, gbps=gbps), m=8, quantization=quantization)
    starts = candidate_placements(table, graph)
    result = solve_ilp(table, None, time_limit_s=20, starts=starts, split_dp=split_dp)
    report = result.report
    assert report.proven_optimal and report.gap == 0.0 and report.sol_status == "Optimal Solution Found", report
    assert result.evaluation is not None and result.evaluation.feasible
    assert report.objective_s == pytest.approx(result.evaluation.step_time_s, rel=1e-6)
    for cand in starts:  # no heuristic placement beats a proven optimum
        ev = evaluate(table, cand)
        assert not ev.feasible or ev.step_time_s >= result.evaluation.step_time_s * (1 - 1e-9)


def test_time_limit_is_reported_honestly() -> None:
    # Eight devices: CBC may not prove optimality within 1 s; the report must then say so.
    spec = [("h0", "rtx5090", None), ("h1", "rtx5090", None), ("h0", "v100", None), ("h0", "rtx3090", None),
            ("h1", "m40", None), ("h0", "v100", None), ("h1", "v100", None), ("h0", "rtx5090", None)]
    graph = make_graph(32, 4096, rng=random.Random(2))
    table, _, _ = table_for(graph, make_cluster(spec), m=8, quantization="nf4")
    result = solve_ilp(table, None, time_limit_s=1.0)
    report = result.report
    assert result.evaluation is not None and result.evaluation.feasible
    assert report.objective_s == pytest.approx(result.evaluation.step_time_s, rel=1e-6)
    if report.proven_optimal:
        assert report.gap == 0.0 and not report.message
    else:
        assert "before optimality was proven" in report.message or "kept the best" in report.message
        assert report.gap is None or 0.0 <= report.gap <= 1.0
