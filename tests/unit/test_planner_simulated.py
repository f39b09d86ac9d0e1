"""One objective: the placement the plan picks is the best by the simulator, the step time the plan reports.

The reference is exhaustive search scored by the simulator (planner/search/bruteforce.py: every device order,
every split, every recomputation the table allows). Fleets have slow links -- 1 GbE between hosts, PCIe
x1 risers inside one -- where the old closed-form optimum simulated up to 25 % slower than another
placement; the Llama-8B fleets are home labs on 1 GbE and a mining rig on risers. planner/search/simbound.py's
lower bound, which the branch and bound prunes with, is checked against the simulator directly.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from itertools import combinations, permutations

import pytest
from fleets import make_cluster, make_graph, make_model
from tables import random_table, with_overheads

from hetero.planner import plan
from hetero.planner.model.cost import CostTable, build_cost_table
from hetero.planner.model.cost_model import RooflineCostModel
from hetero.planner.model.objective import Placement, evaluate
from hetero.planner.search.bruteforce import all_placements, brute_force_simulated
from hetero.planner.search.simbound import lower_bound_s
from hetero.planner.search.simsearch import simulated_step_s
from hetero.planner.search.solve import solve_simulated
from hetero.specs import DataSpec, PlannerOptions, TrainSpec

SLOW = {"1GbE": 1.0, "PCIe x1 riser": 8.0, "10GbE": 10.0}  # Gbit/s


def slow_fleet(rng: random.Random):  # type: ignore[no-untyped-def]
    """2-4 cards of mixed speed and memory on 1-3 hosts, hosts on 1 GbE or 10 GbE, often x1 risers inside one."""
    kinds = ["rtx3090", "rtx4090", "v100", "m40", "rtx5090"]
    spec = [(f"h{rng.randrange(rng.randint(1, 3))}", rng.choice(kinds),
             None if rng.random() < 0.5 else rng.choice([2.0, 3.0, 4.0, 6.0, 10.0])) for _ in range(rng.randint(2, 4))]
    cluster = make_cluster(spec, gbps=rng.choice([SLOW["1GbE"], SLOW["1GbE"], SLOW["10GbE"]]))
    if rng.random() < 0.6:
        cluster = dataclasses.replace(cluster, intra_host_bandwidth_gbps=SLOW["PCIe x1 riser"])
    return cluster


def planned(seed: int) -> tuple[float, float, int]:
    """A random slow-link problem: (the plan's predicted step, the simulated brute-force optimum, stages)."""
    rng = random.Random(seed)
    cluster = slow_fleet(rng)
    graph = make_graph(rng.randint(2, 6), hidden=rng.choice([1024, 2048, 4096]), rng=rng)
    train = TrainSpec(micro_batch_size=1, num_micro_batches=rng.choice([1, 2, 4, 8, 16]),
                      schedule=rng.choice(["1f1b", "1f1b", "gpipe"]))
    options = PlannerOptions(time_limit_s=30.0, replicas=1, recompute=rng.choice(["auto", "auto", "none"]))
    model = make_model(rng.choice(["none", "nf4"]))
    table = build_cost_table(graph, model, cluster, train, options, RooflineCostModel(options.efficiency))
    best = brute_force_simulated(table)
    if best is None:
        return 0.0, 0.0, 0
    p = plan(model, graph, cluster, train, DataSpec(), options)
    return p.prediction.step_time_s, best[1], len(p.stages)


@pytest.mark.parametrize("chunk", range(4))
def test_plan_is_the_simulated_optimum_on_slow_link_fleets(chunk: int) -> None:
    # 4 x 20 derandomized fleets; before issue 22 (the closed-form optimum) 7 of these 80 (78 fit) planned a
    # placement more than 1 % slower than the best, by up to 9.3 %.
    worse, multi = [], 0
    for seed in range(chunk * 20, (chunk + 1) * 20):
        step, best, stages = planned(seed)
        multi += stages > 1
        if step > best * 1.01:
            worse.append((seed, round(step / best, 4)))
        assert step <= best * (1 + 1e-9), f"seed {seed}: plan {step:.6g} s/step, best placement {best:.6g}"
    assert not worse
    assert multi >= 5  # the chunk exercises pipelines, not only single devices


@pytest.mark.parametrize("chunk", range(3))
def test_solve_simulated_matches_brute_force_on_random_arrays(chunk: int) -> None:
    # Random dense tables (classes of identical devices, tight memory, recomputation, both schedules) with
    # message, sync and optimizer costs; sometimes a forced stage count. Proven, and the exhaustive optimum.
    proven = 0
    for seed in range(chunk * 40, (chunk + 1) * 40):
        rng = random.Random(seed)
        table = with_overheads(rng, random_table(rng, max_devices=4, max_nodes=5))
        forced = rng.choice([None, None, None, 2, 3])
        if forced and forced > min(table.num_nodes, table.num_devices):
            forced = None
        best = brute_force_simulated(table, forced)
        result = solve_simulated(table, forced, time_limit_s=60)
        if best is None:
            assert result.evaluation is None, f"seed {seed}"
            continue
        ev = result.evaluation
        assert ev is not None and ev.feasible, f"seed {seed}: {result.report}"
        if forced:
            assert len(ev.placement.devices) == forced
        step = simulated_step_s(table, ev)
        assert step <= best[1] * (1 + 1e-9), f"seed {seed}: {step} vs {best[1]}"
        assert result.report.proven_optimal and result.report.objective_s == pytest.approx(step, rel=1e-12)
        proven += 1
    assert proven >= 20  # the rest fit nowhere (tight memory)


def test_lower_bound_never_exceeds_the_simulation() -> None:
    # Random placements (random recomputation too) of random tables with overheads, both schedules.
    ratios, single = [], []
    for seed in range(150):
        rng = random.Random(10_000 + seed)
        table = with_overheads(rng, random_table(rng, max_devices=4, max_nodes=6))
        options = list(all_placements(table.num_nodes, table.num_devices))
        for p in rng.sample(options, min(8, len(options))):
            recompute = tuple(rng.choice(table.recompute_choices(a, b)) for a, b in p.spans)
            ev = evaluate(table, Placement(p.devices, p.spans, recompute))
            bound, step = lower_bound_s(table, ev), simulated_step_s(table, ev)
            assert bound <= step * (1 + 1e-9), f"seed {seed} {p}: bound {bound} > simulated {step}"
            (single if len(p.devices) == 1 else ratios).append(bound / step)
    # Tight where it must be (one stage: exactly its work plus the step), useful elsewhere (it prunes).
    assert min(single) == pytest.approx(1.0, rel=1e-9) and len(ratios) > 500
    assert statistics.median(ratios) > 0.9


def test_a_search_cut_off_by_the_time_limit_says_what_it_proved() -> None:
    # Sixteen cards of many kinds on four hosts over 1 GbE: the closed form needs the ILP and the
    # simulated search cannot finish in 2 s. It stops in time, is not called proven, and says how far it got.
    import time

    from fleets import TYPES, table_for

    from hetero.planner.explain.baselines import candidate_placements

    rng = random.Random(5)
    spec = [(f"h{rng.randrange(4)}", rng.choice(list(TYPES)), rng.choice([None, 12.0, 20.0])) for _ in range(16)]
    graph = make_graph(40, 4096, rng=rng)
    table, _, _ = table_for(graph, make_cluster(spec, gbps=SLOW["1GbE"]), m=8, quantization="nf4")
    t0 = time.perf_counter()
    result = solve_simulated(table, None, time_limit_s=2.0, starts=candidate_placements(table, graph))
    assert time.perf_counter() - t0 <= 2.0 + 1.0
    report, ev = result.report, result.evaluation
    assert ev is not None and ev.feasible and not report.proven_optimal
    assert report.objective_s == pytest.approx(simulated_step_s(table, ev), rel=1e-12)
    assert "cut off by the time limit" in report.message and "closed-form optimum" in report.message
    assert report.lower_bound_s is not None and 0 < report.lower_bound_s <= report.objective_s
    assert report.gap == pytest.approx(1 - report.lower_bound_s / report.objective_s)
    # With no time left for the search at all (the closed form's solve took it, as on a fast machine where the ILP
    # finished), the step the plan reports is still the simulated step of the placement it returns, not the closed
    # form's (it said 5.08 s for a placement that simulates at 6.09 s).
    late = solve_simulated(table, None, time_limit_s=2.0, starts=candidate_placements(table, graph),
                           deadline=time.perf_counter())
    assert late.evaluation is not None and not late.report.proven_optimal
    assert late.report.objective_s == pytest.approx(simulated_step_s(table, late.evaluation), rel=1e-12)
    assert "cut off by the time limit" in late.report.message


# --- Llama-8B on home-lab fleets ---------------------------------------------------------------------


def llama8b_graph():  # type: ignore[no-untyped-def]
    from hetero import config as config_mod
    from hetero.compiler.trace import trace

    cfg = config_mod.load(["model=llama8b"])
    return cfg, trace(cfg.model)


def home_fleet(hosts: list[list[tuple[str, int]]], gbps: float, intra_gbps: float = 128.0):  # type: ignore[no-untyped-def]
    from hetero.hardware import build_cluster, load_device_types

    raw = {"name": "home", "default_link": {"bandwidth_gbps": gbps, "latency_us": 200},
           "intra_host_bandwidth_gbps": intra_gbps,
           "hosts": [{"name": f"h{i}", "address": f"10.0.0.{i + 1}",
                      "devices": [{"type": t, "count": c} for t, c in devs]} for i, devs in enumerate(hosts)]}
    return build_cluster(raw, load_device_types())


def placements_up_to(table: CostTable, most: int):  # type: ignore[no-untyped-def]
    """Every order of every device subset of up to ``most`` stages, every split at node granularity
    (identical devices once: their orders are the same placement)."""
    classes = table.device_classes()
    n = table.num_nodes
    for s in range(1, most + 1):
        seen = set()
        for devices in permutations(range(table.num_devices), s):
            key = tuple(classes[d] for d in devices)
            if key in seen:
                continue
            seen.add(key)
            for cuts in combinations(range(1, n), s - 1):
                bounds = (0, *cuts, n)
                yield Placement(devices, tuple((bounds[k], bounds[k + 1] - 1) for k in range(s)))


FLEETS = {
    # (hosts with their cards, link between hosts Gbit/s, inside a host Gbit/s, stages the brute force tries)
    "homelab on 1 GbE": ([[("rtx5090", 1)], [("strix_halo", 1)]], 1.0, 128.0, 2),
    "three hosts on 1 GbE": ([[("rtx3090", 1)], [("rtx4090", 1)], [("rtx5090", 1)]], 1.0, 128.0, 3),
    "mixed three hosts on 1 GbE": ([[("rtx3090", 1)], [("rtx3080", 1)], [("v100_16gb", 1)]], 1.0, 128.0, 3),
    "mining rig on x1 risers": ([[("rtx3090", 2), ("rtx3080", 1)]], 1.0, 8.0, 3),
    "mining rig on PCIe 2.0 x1 risers": ([[("rtx4090", 1), ("rtx3080", 2)]], 1.0, 4.0, 3),
}


@pytest.mark.parametrize("name", list(FLEETS))
def test_llama8b_on_slow_links_is_the_simulated_optimum(name: str) -> None:
    # Before issue 22 the plans of four of these five were 7.6 %, 11.3 %, 2.2 % and 1.8 % slower than the best.
    hosts, gbps, intra, most = FLEETS[name]
    cfg, graph = llama8b_graph()
    cluster = home_fleet(hosts, gbps, intra)
    # One chunk per device: the brute force and the proof are over such placements (interleaving, where it wins
    # on these fleets now that chunks may recompute, is tests/unit/test_interleaved.py's).
    p = plan(cfg.model, graph, cluster, cfg.train, cfg.data, dataclasses.replace(cfg.planner, replicas=1,
                                                                                 interleave="off"))
    table = build_cost_table(graph, cfg.model, cluster, cfg.train, cfg.planner,
                             RooflineCostModel(cfg.planner.efficiency))
    best = brute_force_simulated(table, every_recompute=False, placements=placements_up_to(table, most))
    assert best is not None
    step = p.prediction.step_time_s
    assert step <= best[1] * 1.01, f"{name}: plan {step:.4g} s/step, brute force {best[1]:.4g}"
    assert step <= best[1] * (1 + 1e-9)  # in fact never slower at all
    assert p.solver.proven_optimal and p.solver.objective_s == pytest.approx(step, rel=1e-12)
    assert any(line.startswith("Placement proven optimal by the simulated step time") for line in p.verdict), p.verdict
