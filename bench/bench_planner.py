"""W2 (BENCHMARKS.md): planner solve time, proof, gap and predicted step time vs baselines.

Models: llama8b and llama70b as `hetero compile` traces them (meta device), nf4 and bf16
(quantization none), with their conf/model training settings. Fleets:

- every file in conf/hardware/ (as `hardware=<name>` loads it);
- mining rigs of 8-16 cards of 2-4 kinds in one box on x1 risers, and 4 hosts x 4 GPUs on 10 GbE:
  the fleets the exact DP is for (<= 16 devices, <= 4 device classes);
- random fleets of 2, 4, 8, 16 datasheet GPUs over 1-4 hosts (often more classes: the ILP's turf).

The acceptance (issue #10): every fleet of up to 16 devices and 4 device classes proven optimal (or
proven infeasible) in <= 2 s of solve time. ``planner_rows`` returns every row (a list of dicts) and
``rig_rows`` the acceptance rows, for ``python -m bench``.

Usage: python bench/bench_planner.py [time_limit_s] [--rigs]
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

from hetero import config as config_mod
from hetero.compiler.trace import trace
from hetero.graph import LayerGraph
from hetero.hardware import build_cluster, load_device_types
from hetero.planner.explain.baselines import baselines, candidate_placements
from hetero.planner.model.cost import build_cost_table
from hetero.planner.model.cost_model import RooflineCostModel
from hetero.planner.model.predict import predict
from hetero.planner.search.solve import solve
from hetero.specs import ClusterSpec, ModelSpec, PlannerOptions, TrainSpec

MODELS = ("llama8b", "llama70b")
QUANTS = ("nf4", "none")  # none: bf16 weights
SHIPPED = ("homelab", "local", "mining_rig", "mixed_fleet")
RIG_LIMIT_S = 2.0  # the acceptance: proven within this much solve time


def _rig(name: str, cards: list[tuple[str, int]]) -> dict[str, Any]:
    """One box of GPUs on PCIe x1 risers (8 Gb/s between cards), as conf/hardware/mining_rig.yaml."""
    return {"name": name, "hosts": [{"name": "rig", "devices": [{"type": t, "count": c} for t, c in cards]}],
            "intra_host_bandwidth_gbps": 8}


def _hosts(name: str, per_host: list[tuple[str, int]]) -> dict[str, Any]:
    """One host per entry (``count`` GPUs of one type, PCIe 4.0 inside), every pair on 10 GbE."""
    hosts = [{"name": f"box{i}", "address": f"10.0.0.{i + 1}", "devices": [{"type": t, "count": c}]}
             for i, (t, c) in enumerate(per_host)]
    return {"name": name, "hosts": hosts, "default_link": {"bandwidth_gbps": 10, "latency_us": 100}}


RIGS = [
    _rig("rig_4x3090_4x3080", [("rtx3090", 4), ("rtx3080", 4)]),
    _rig("rig_8x3090_8x3080", [("rtx3090", 8), ("rtx3080", 8)]),
    _rig("rig_6x3090_4x3080_2x4090", [("rtx3090", 6), ("rtx3080", 4), ("rtx4090", 2)]),
    _rig("rig_6x3090_4x3080_4x4090_2x5090", [("rtx3090", 6), ("rtx3080", 4), ("rtx4090", 4), ("rtx5090", 2)]),
    _rig("rig_8x3090_4x3080_2x4090_2xv100", [("rtx3090", 8), ("rtx3080", 4), ("rtx4090", 2), ("v100_32gb", 2)]),
    _hosts("4hosts_4x3090", [("rtx3090", 4)] * 4),
    _hosts("4hosts_3090_3090_4090_3080", [("rtx3090", 4), ("rtx3090", 4), ("rtx4090", 4), ("rtx3080", 4)]),
]
RANDOM_TYPES = ("rtx3080", "rtx3090", "rtx4090", "rtx5090", "v100_16gb", "v100_32gb", "m40_24gb", "a100_40gb",
                "rx7900xtx", "mi100")


def _random_fleets(rng: random.Random) -> list[dict[str, Any]]:
    fleets = []
    for count in (2, 4, 8, 16):
        hosts = rng.randint(1, 4)
        per_host: dict[int, list[dict[str, Any]]] = {}
        for _ in range(count):
            per_host.setdefault(rng.randrange(hosts), []).append({"type": rng.choice(RANDOM_TYPES)})
        fleets.append({"name": f"random_{count}", "default_link": {"bandwidth_gbps": 10, "latency_us": 100},
                       "hosts": [{"name": f"h{h}", "address": f"10.1.0.{h + 1}", "devices": devs}
                                 for h, devs in sorted(per_host.items())]})
    return fleets


def _row(model: ModelSpec, graph: LayerGraph, cluster: ClusterSpec, train: TrainSpec, options: PlannerOptions,
         kind: str) -> dict[str, Any]:
    """Build the cost table, solve, and predict as planner.plan does; one row of numbers."""
    t0 = time.perf_counter()
    table = build_cost_table(graph, model, cluster, train, options, RooflineCostModel(options.efficiency))
    table_s = time.perf_counter() - t0
    result = solve(table, options.num_stages, options.time_limit_s, starts=candidate_placements(table, graph))
    report = result.report
    row: dict[str, Any] = {
        "model": model.name, "quant": model.quantization, "fleet": cluster.name, "kind": kind,
        "devices": len(cluster.devices), "hosts": len(cluster.hosts), "classes": len(set(table.device_classes())),
        "solver": report.solver, "status": report.status, "proven": report.proven_optimal,
        "infeasible": result.evaluation is None and report.status == "Infeasible",
        "solve_s": report.solve_time_s, "table_s": table_s, "gap": report.gap, "stages": None, "step_s": None,
        "x_single": None, "x_even": None, "x_tflops": None, "message": report.message,
    }
    if result.evaluation is not None:
        prediction, _ = predict(table, result.evaluation)
        row["stages"] = len(result.evaluation.placement.devices)
        row["step_s"] = prediction.step_time_s
        for b, key in zip(baselines(table, graph.decoder_indices()), ("x_single", "x_even", "x_tflops"), strict=True):
            if b.prediction is not None:
                row[key] = b.prediction.step_time_s / prediction.step_time_s
    return row


def planner_rows(time_limit_s: float = 30.0, include_random: bool = True,
                 models: tuple[str, ...] = MODELS, quants: tuple[str, ...] = QUANTS) -> list[dict[str, Any]]:
    """Every (model, quantization, fleet) of W2 as a dict (see _row for the keys)."""
    types = load_device_types()
    rng = random.Random(0)
    randoms = _random_fleets(rng) if include_random else []
    rows = []
    for name in models:
        for quant in quants:
            base = config_mod.load([f"model={name}", f"model.quantization={quant}", "hardware=mining_rig"])
            graph = trace(base.model)
            options = PlannerOptions(**{**base.planner.__dict__, "time_limit_s": time_limit_s})
            for fleet in SHIPPED:
                cfg = config_mod.load([f"model={name}", f"model.quantization={quant}", f"hardware={fleet}"])
                rows.append(_row(cfg.model, graph, cfg.cluster, cfg.train, options, "shipped"))
            for spec in RIGS:
                rows.append(_row(base.model, graph, build_cluster(spec, types), base.train, options, "rig"))
            for spec in randoms:
                rows.append(_row(base.model, graph, build_cluster(spec, types), base.train, options, "random"))
    return rows


def rig_rows(time_limit_s: float = 30.0) -> list[dict[str, Any]]:
    """The acceptance rows (fleets of <= 16 devices in <= 4 classes: shipped and rigs), compact for a table.

    ``proven``: the solver proved its answer -- the optimum, or that nothing fits (``result`` says which).
    """
    out = []
    for row in planner_rows(time_limit_s, include_random=False):
        if row["devices"] > 16 or row["classes"] > 4:
            continue
        result = "infeasible" if row["infeasible"] else ("optimal" if row["proven"] else "unproven")
        out.append({"model": row["model"], "quant": row["quant"], "fleet": row["fleet"], "devices": row["devices"],
                    "classes": row["classes"], "solver": row["solver"], "result": result,
                    "proven": row["proven"] or row["infeasible"], "solve_s": row["solve_s"], "gap": row["gap"],
                    "stages": row["stages"], "step_s": row["step_s"]})
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    """Print one line per row, then the acceptance summary over fleets of <= 16 devices and <= 4 classes."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    limit = float(args[0]) if args else 30.0
    print(f"{'model':9} {'quant':5} {'fleet':32} {'dev':>3} {'cls':>3} {'solver':9} {'proven':>6} {'solve s':>7} "
          f"{'gap':>6} {'stg':>3} {'step s':>7} {'x single':>8} {'x even':>6} {'x tflops':>8}")
    rows = []
    for row in planner_rows(limit, include_random="--rigs" not in sys.argv):
        rows.append(row)
        proven = "infeas" if row["infeasible"] else ("yes" if row["proven"] else "no")
        gap = "-" if row["gap"] is None else f"{row['gap']:.1%}"
        print(f"{row['model']:9} {row['quant']:5} {row['fleet']:32} {row['devices']:>3} {row['classes']:>3} "
              f"{row['solver']:9} {proven:>6} {row['solve_s']:7.2f} {gap:>6} {_fmt(row['stages'], 'd'):>3} "
              f"{_fmt(row['step_s'], '.2f'):>7} {_fmt(row['x_single'], '.2f'):>8} {_fmt(row['x_even'], '.2f'):>6} "
              f"{_fmt(row['x_tflops'], '.2f'):>8}", flush=True)
        if not (row["proven"] or row["infeasible"]):
            print(f"{'':9} {row['solver']}: {row['message']}", flush=True)
    rigs = [r for r in rows if r["devices"] <= 16 and r["classes"] <= 4]
    settled = [r for r in rigs if r["proven"] or r["infeasible"]]
    fast = [r for r in settled if r["solve_s"] <= RIG_LIMIT_S]
    worst = max((r["solve_s"] for r in rigs), default=0.0)
    print(f"W2 summary: fleets of <= 16 devices and <= 4 classes: {len(settled)}/{len(rigs)} proven "
          f"(optimal or infeasible), {len(fast)}/{len(rigs)} within {RIG_LIMIT_S:g} s; max solve time {worst:.2f} s. "
          f"All rows: {sum(r['proven'] or r['infeasible'] for r in rows)}/{len(rows)} proven, max solve time "
          f"{max((r['solve_s'] for r in rows), default=0.0):.2f} s (limit {limit:g} s).")


if __name__ == "__main__":
    main()
