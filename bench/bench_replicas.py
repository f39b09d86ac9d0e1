"""Data x pipeline replicas on this CPU: 2 replicas x 1 stage against 1 replica x 2 stages (W1 model).

    python bench/bench_replicas.py [--steps 6] [--rounds 2] [--out DIR]

Workload W1's model (w1_model.py: hidden 256, 8 layers, seq 128, 8 micro-batches of 4, LoRA r=8
on every projection) on two one-thread CPU devices of this host. `hetero profile` measures them,
then three plans are compiled from the same profile:

  replicas   planner.replicas=2 planner.num_stages=1: each device trains the whole model on its
             share of the micro-batches; LoRA gradients are summed through the coordinator
  pipeline   planner.replicas=1 planner.num_stages=2: one 1F1B pipeline over both devices
  auto       the planner's own choice (neither forced)

The first two run alternately (``--rounds`` pairs, the order swapped each round: this machine's
speed drifts), each for ``--steps`` steps; a run's figure is its median step time after the first
two. Printed: per plan the predicted and measured step time and their ratio (target: within 15%),
which one is faster, and whether the auto plan picked it. Takes about 3 minutes on 2 cores; never
part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from w1_hetero import free_ports
from w1_model import LR, MICRO_BATCH, NUM_MICRO, SEQ_LEN, median_tail, prepare

from hetero.runtime.run.metrics_file import NAME, read_metrics

FLEET = """\
name: w1pair
hosts:
  - name: localhost
    address: 127.0.0.1
    port: {port}
    devices:
      - {{type: cpu, count: 2, threads: 1}}
"""
FORCED = {"replicas": ("planner.replicas=2", "planner.num_stages=1"),
          "pipeline": ("planner.replicas=1", "planner.num_stages=2")}


def hetero(*args: str, cwd: Path) -> None:
    """Run a hetero command, failing loudly with its output."""
    proc = subprocess.run([sys.executable, "-m", "hetero.cli", *args], capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        sys.exit(f"hetero {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def shape(plan: dict[str, Any]) -> str:
    """'2 x 1' (replicas x stages per replica) of a plan.json."""
    replicas = plan.get("replicas") or [{"stages": list(range(len(plan["stages"])))}]
    return f"{len(replicas)} x {len(replicas[0]['stages'])}"


def run(plan: Path, run_dir: Path, steps: int, cwd: Path) -> float:
    hetero("run", str(plan), f"steps={steps}", "--run-dir", str(run_dir), "--no-progress", cwd=cwd)
    return median_tail([s.step_time_s for s in read_metrics(run_dir / NAME).steps])


def bench(out: Path, steps: int, rounds: int) -> dict[str, Any]:
    model_dir, data = prepare(out, steps)
    conf = out / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    (conf / "hardware" / "w1pair.yaml").write_text(FLEET.format(port=free_ports(4) + 1))
    common = ["-cd", str(conf), "model=hf", f"model.pretrained={model_dir}", f"model.seq_len={SEQ_LEN}",
              "model.dtype=float32", "lora.r=8", "lora.alpha=16", "hardware=w1pair",
              f"train.micro_batch_size={MICRO_BATCH}", f"train.num_micro_batches={NUM_MICRO}", f"train.lr={LR}",
              f"data.path={data}", "data.format=tokens"]
    profile = out / "profile.json"
    hetero("profile", *common, f"output={profile}", cwd=out)
    plans: dict[str, dict[str, Any]] = {}
    for name, forced in [*FORCED.items(), ("auto", ())]:
        hetero("compile", *common, f"profile={profile}", f"train.steps={steps}", *forced, f"output={out / name}",
               cwd=out)
        plans[name] = json.loads((out / name / "plan.json").read_text())
    measured: dict[str, list[float]] = {name: [] for name in FORCED}
    for r in range(rounds):
        order = list(FORCED) if r % 2 == 0 else list(reversed(FORCED))
        for name in order:
            measured[name].append(run(out / name / "plan.json", out / f"run-{name}-{r}", steps, out))
            print(f"  round {r}: {name} ({shape(plans[name])}) {measured[name][-1]:.3f} s/step", flush=True)
    rows = {}
    for name in FORCED:
        predicted = plans[name]["prediction"]["step_time_s"]
        m = statistics.median(measured[name])
        rows[name] = {"shape": shape(plans[name]), "predicted_s": predicted, "measured_s": m, "ratio": m / predicted}
    faster = min(rows, key=lambda n: rows[n]["measured_s"])
    return {"rows": rows, "faster": faster, "auto": shape(plans["auto"]),
            "auto_predicted_s": plans["auto"]["prediction"]["step_time_s"], "steps": steps, "rounds": rounds}


def print_report(result: dict[str, Any]) -> None:
    print(f"{'plan':<10} {'replicas x stages':>17} {'predicted s':>12} {'measured s':>11} {'measured/predicted':>19} "
          f"{'within 15%':>10}")
    for name, row in result["rows"].items():
        ok = "yes" if abs(row["ratio"] - 1) <= 0.15 else "NO"
        print(f"{name:<10} {row['shape']:>17} {row['predicted_s']:>12.3f} {row['measured_s']:>11.3f} "
              f"{row['ratio']:>19.2f} {ok:>10}")
    faster = result["rows"][result["faster"]]
    picked = "yes" if result["auto"] == faster["shape"] else "NO"
    print(f"faster measured: {result['faster']} ({faster['shape']}); the planner's own choice: {result['auto']} "
          f"(predicted {result['auto_predicted_s']:.3f} s) -- picked the faster one: {picked}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    out.mkdir(parents=True, exist_ok=True)
    result = bench(out.resolve(), args.steps, args.rounds)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
