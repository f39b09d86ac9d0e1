"""Does a profiled plan predict reality? measured / predicted step time for the tiny model on this CPU.

    python bench/bench_prediction.py [--steps 5] [--out /tmp/hetero-bench-prediction]

For 2 and 3 local stages and 4 and 16 micro-batches: `hetero profile`, `hetero compile profile=...`,
`hetero run`, then print measured / predicted (median step after the first). Then the slow-stage
case: a fleet whose second CPU stage has fewer threads than the first; the profiled plan should
move layers off it and its measured step should beat the even split's measured step.
Takes a few minutes; never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def hetero(*args: str) -> None:
    """Run a hetero command, failing loudly with its output."""
    proc = subprocess.run([sys.executable, "-m", "hetero.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"hetero {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def measured_vs_predicted(run_dir: Path) -> tuple[float, float, list[int]]:
    plan = json.loads((run_dir / "plan.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    measured = statistics.median(s["step_time_s"] for s in steps[1:] or steps)
    layers = [sum(1 for n in s["node_names"] if n.startswith("layers.")) for s in plan["stages"]]
    return measured, plan["prediction"]["step_time_s"], layers


def compile_and_run(out: Path, name: str, steps: int, overrides: list[str], config_dir: list[str]) -> tuple[float, float, list[int]]:
    plan_dir = out / name
    hetero("compile", *config_dir, *overrides, f"output={plan_dir}", "planner.time_limit_s=10")
    hetero("run", str(plan_dir / "plan.json"), f"steps={steps}", "--run-dir", str(out / f"run-{name}"), "--no-progress")
    return measured_vs_predicted(out / f"run-{name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("/tmp/hetero-bench-prediction"))
    ap.add_argument("--skip-slow-stage", action="store_true")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(f"{'stages':>6} {'micro-batches':>13} {'predicted s':>11} {'measured s':>10} {'measured/predicted':>18}")
    for stages in (2, 3):
        fleet = [f"hardware.num_devices={stages}"]
        profile = out / f"profile-{stages}.json"
        hetero("profile", "model=tiny", "hardware=local", *fleet, f"output={profile}")
        for m in (4, 16):
            measured, predicted, _ = compile_and_run(
                out, f"s{stages}-m{m}", args.steps, [*fleet, f"profile={profile}", f"train.num_micro_batches={m}"], [])
            print(f"{stages:>6} {m:>13} {predicted:>11.4f} {measured:>10.4f} {measured / predicted:>18.2f}", flush=True)
    if args.skip_slow_stage:
        return
    fleets = out / "fleets" / "hardware"
    fleets.mkdir(parents=True, exist_ok=True)
    (fleets / "uneven.yaml").write_text(
        "name: uneven\nhosts:\n  - name: localhost\n    address: 127.0.0.1\n    port: 29600\n    devices:\n"
        "      - {type: cpu, threads: 2}\n      - {type: cpu, threads: 1}\n")
    cd = ["--config-dir", str(out / "fleets")]
    profile = out / "profile-uneven.json"
    hetero("profile", *cd, "model=tiny", "hardware=uneven", f"output={profile}")
    even = compile_and_run(out, "uneven-even", args.steps, ["hardware=uneven", "planner.split=[3,3]"], cd)
    planned = compile_and_run(out, "uneven-profiled", args.steps, ["hardware=uneven", f"profile={profile}"], cd)
    print(f"slow second stage (threads 2 vs 1): even split {even[2]} measured {even[0]:.4f} s/step; "
          f"profiled plan {planned[2]} measured {planned[0]:.4f} s/step (predicted {planned[1]:.4f}); "
          f"speed-up {even[0] / planned[0]:.2f}x")


if __name__ == "__main__":
    main()
