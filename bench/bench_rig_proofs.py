"""Issue 36: rig-scale compiles by the simulated step, with and without the step form's bound.

The four compiles of the issue: llama8b, nf4 and bf16 (quantization none), at planner.time_limit_s=10, on
12 cards of 3 kinds in one box on x1 risers (8 Gb/s between cards) and on 4 hosts x 4 RTX 3090 on 1 GbE.
Each is planned twice in the same run, as `hetero compile` plans it (planner.plan): as the planner is, and
with planner/search/step_bound.py switched off (the search alone: its cut-off bound and its incumbent). Printed:
the plan's step, the pipeline search's lower bound and gap (the part the plan names as not proven), whether
the replica search settled its question, the whole plan's lower bound and gap (the replica question
included) and the time the compile took.

Usage: python bench/bench_rig_proofs.py [time_limit_s]
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hetero import config as config_mod
from hetero.compiler.trace import trace
from hetero.hardware import build_cluster
from hetero.planner import plan

RIG12 = {"name": "rig12_3090_3080_4090", "intra_host_bandwidth_gbps": 8, "hosts": [
    {"name": "rig", "address": "127.0.0.1",
     "devices": [{"type": "rtx3090", "count": 4}, {"type": "rtx3080", "count": 4}, {"type": "rtx4090", "count": 4}]}]}
HOSTS4 = {"name": "4hosts_4x3090_1gbe",
          "hosts": [{"name": f"h{i}", "address": f"10.0.0.{i + 1}", "devices": [{"type": "rtx3090", "count": 4}]}
                    for i in range(4)],
          "default_link": {"bandwidth_gbps": 1, "latency_us": 100}}
PASS_GAP = 0.05  # the acceptance's alternative to a proof: the unproven part's bound within 5 %


def _pipeline_bound(p: Any) -> float | None:
    """The lower bound the plan gives for the placement part (its message says it), else the plan's own."""
    r = p.solver
    return r.lower_bound_s if r.settled.get("placement", r.proven_optimal) else _from_reason(r.unsettled["placement"])


def _from_reason(reason: str, marker: str = "best lower bound ") -> float | None:
    if marker not in reason:
        return None
    return float(reason.split(marker)[1].split(" ")[0])


def _replica_bound(p: Any) -> float | None:
    """The replica search's own bound on every plan of replicas, where the plan leaves that question open."""
    reason = p.solver.unsettled.get("replicas", "")
    return _from_reason(reason, "every plan of replicas takes at least ")


def compile_row(fleet: dict[str, Any], quant: str, limit_s: float, with_bound: bool) -> dict[str, Any]:
    import hetero.planner.search.solve as solve_mod

    cfg = config_mod.load(["model=llama8b", f"model.quantization={quant}", f"planner.time_limit_s={limit_s:g}"])
    graph = trace(cfg.model)
    cluster = build_cluster(fleet)
    saved = solve_mod.least_step_bound
    if not with_bound:
        solve_mod.least_step_bound = lambda *a, **k: None  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        p = plan(cfg.model, graph, cluster, cfg.train, cfg.data, cfg.planner)
        took = time.perf_counter() - t0
    finally:
        solve_mod.least_step_bound = saved
    step, low = p.prediction.step_time_s, _pipeline_bound(p)
    return {"fleet": cluster.name, "quant": quant, "bound": with_bound, "step_s": step, "stages": len(p.stages),
            "replicas": len(p.pipelines), "proven": p.solver.proven_optimal, "pipeline_lower_s": low,
            "pipeline_gap": None if low is None else max(0.0, 1 - low / step), "plan_lower_s": p.solver.lower_bound_s,
            "replicas_settled": p.solver.settled.get("replicas", p.solver.proven_optimal),
            "replica_lower_s": _replica_bound(p),
            "plan_gap": None if p.solver.lower_bound_s is None else max(0.0, 1 - p.solver.lower_bound_s / step),
            "compile_s": took}


def main() -> None:
    limit = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    print(f"{'fleet':24} {'quant':5} {'bound':5} {'step s':>7} {'stg':>3} {'rep':>3} {'proven':>6} "
          f"{'pipe LB':>8} {'pipe gap':>8} {'rep ok':>6} {'rep LB':>7} {'plan LB':>8} {'plan gap':>8} {'compile s':>9}")
    passed = whole = 0
    for fleet in (RIG12, HOSTS4):
        for quant in ("none", "nf4"):
            rows = [compile_row(fleet, quant, limit, with_bound) for with_bound in (False, True)]
            for r in rows:
                gap = "-" if r["pipeline_gap"] is None else f"{r['pipeline_gap']:.1%}"
                low = "-" if r["pipeline_lower_s"] is None else f"{r['pipeline_lower_s']:.3f}"
                plan_low = "-" if r["plan_lower_s"] is None else f"{r['plan_lower_s']:.3f}"
                plan_gap = "-" if r["plan_gap"] is None else f"{r['plan_gap']:.1%}"
                rep_low = "-" if r["replica_lower_s"] is None else f"{r['replica_lower_s']:.3f}"
                print(f"{r['fleet']:24} {r['quant']:5} {str(r['bound']):5} {r['step_s']:7.3f} {r['stages']:>3} "
                      f"{r['replicas']:>3} {str(r['proven']):>6} {low:>8} {gap:>8} {str(r['replicas_settled']):>6} "
                      f"{rep_low:>7} {plan_low:>8} {plan_gap:>8} {r['compile_s']:9.1f}")
            before, after = rows
            ok = after["proven"] or (after["pipeline_gap"] is not None and after["pipeline_gap"] <= PASS_GAP)
            plan_ok = after["proven"] or (after["plan_gap"] is not None and after["plan_gap"] <= PASS_GAP)
            passed += ok
            whole += plan_ok
            print(f"  -> step with the bound / without: {after['step_s'] / before['step_s']:.3f}; pipeline part "
                  f"{'proven' if after['proven'] else 'within 5 %' if ok else 'NOT within 5 %'}; whole plan "
                  f"{'proven' if after['proven'] else 'within 5 %' if plan_ok else 'NOT within 5 %'}", flush=True)
    print(f"rig proofs: {passed}/4 compiles proven or with the placement's bound within {PASS_GAP:.0%}; "
          f"{whole}/4 with the whole plan's (the replica question included)")


if __name__ == "__main__":
    main()
