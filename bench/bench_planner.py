"""W2 (BENCHMARKS.md): planner solve time, proven gap, predicted step time vs baselines.

Synthetic Llama-shaped LayerGraphs (8B: 32 layers x 4096, 70B: 80 layers x 8192) on random fleets
of 2, 4, 8, 16 datasheet devices over 1-4 hosts. Usage: python bench/bench_planner.py [time_limit_s]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_planner_ilp import TYPES, make_cluster, make_graph, make_model  # noqa: E402

from hetero.errors import InfeasiblePlanError  # noqa: E402
from hetero.planner import plan  # noqa: E402
from hetero.specs import DataSpec, PlannerOptions, TrainSpec  # noqa: E402


class _Uniform(random.Random):
    def uniform(self, a: float, b: float) -> float:  # real decoder layers are all the same size
        return 1.0


def main() -> None:
    """Print one line per (model, quantization, fleet size)."""
    limit = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    rng = random.Random(0)
    graphs = {"llama8b": make_graph(32, 4096, rng=_Uniform()), "llama70b": make_graph(80, 8192, rng=_Uniform())}
    print(f"{'model':9} {'quant':5} {'devs':>4} {'solve s':>8} {'gap':>6} {'step s':>8} "
          f"{'x single':>8} {'x even':>7} {'x tflops':>8}")
    for name, graph in graphs.items():
        for quant in ("nf4", "none"):
            for n_dev in (2, 4, 8, 16):
                n_hosts = rng.randint(1, 4)
                spec = [(f"h{rng.randrange(n_hosts)}", rng.choice(list(TYPES)), None) for _ in range(n_dev)]
                cluster = make_cluster(spec, gbps=10.0)
                train = TrainSpec(micro_batch_size=1, num_micro_batches=8)
                try:
                    p = plan(make_model(quant), graph, cluster, train, DataSpec(), PlannerOptions(time_limit_s=limit))
                except InfeasiblePlanError as exc:
                    print(f"{name:9} {quant:5} {n_dev:>4}  infeasible: {str(exc)[:90]}")
                    continue
                step = p.prediction.step_time_s
                ratios = []
                for b in p.baselines:
                    ratios.append(f"{b.prediction.step_time_s / step:.2f}" if b.prediction else "-")
                gap = "-" if p.solver.gap is None else f"{p.solver.gap:.1%}"
                print(f"{name:9} {quant:5} {n_dev:>4} {p.solver.solve_time_s:8.2f} {gap:>6} {step:8.2f} "
                      f"{ratios[0]:>8} {ratios[1]:>7} {ratios[2]:>8}")


if __name__ == "__main__":
    main()
