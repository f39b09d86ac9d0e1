"""Held-out evaluation on a spare device: how much does it slow training? (W1 model, this CPU)

    python bench/bench_eval.py [--steps 8] [--rounds 3] [--every 2] [--out DIR]

Workload W1's model (w1_model.py) trains as one 1-thread CPU stage; the fleet's second CPU
device is kept out of training at compile (eval.device) and, in the "eval" runs, evaluates the
latest adapter on 8 held-out micro-batches every ``--every`` steps while training goes on (a separate
process, 1 thread). Runs with and without evaluation alternate (``--rounds`` pairs, order swapped
each round); a run's figure is its median step time after the first two steps. Printed: both
medians, their ratio (target: eval runs at most 5% slower), and the eval_loss lines the eval runs
wrote. About 2 minutes on 2 cores; never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_replicas import hetero
from w1_hetero import free_ports
from w1_model import LR, MICRO_BATCH, NUM_MICRO, SEQ_LEN, W1_ARCH, median_tail, prepare

from hetero.runtime.run.metrics_file import NAME, EvalLine, read_metrics

FLEET = """\
name: w1eval
hosts:
  - name: localhost
    address: 127.0.0.1
    port: {port}
    devices:
      - {{type: cpu, count: 2, threads: 1}}
"""
EVAL_BATCHES = 8


def run(plan: Path, run_dir: Path, steps: int, cwd: Path, extra: list[str]) -> tuple[float, list[EvalLine]]:
    hetero("run", str(plan), f"steps={steps}", "--run-dir", str(run_dir), "--no-progress", *extra, cwd=cwd)
    lines = read_metrics(run_dir / NAME)
    return median_tail([s.step_time_s for s in lines.steps]), lines.evals


def bench(out: Path, steps: int, rounds: int, every: int) -> dict[str, Any]:
    model_dir, data = prepare(out, steps)
    held_out = out / "held-out.jsonl"
    rng = random.Random(1)
    with held_out.open("w") as f:
        for _ in range(EVAL_BATCHES * MICRO_BATCH):
            f.write(json.dumps({"input_ids": [rng.randrange(3, W1_ARCH["vocab_size"]) for _ in range(SEQ_LEN)]}) + "\n")
    conf = out / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    (conf / "hardware" / "w1eval.yaml").write_text(FLEET.format(port=free_ports(4) + 1))
    hetero("compile", "-cd", str(conf), "model=hf", f"model.pretrained={model_dir}", f"model.seq_len={SEQ_LEN}",
           "model.dtype=float32", "lora.r=8", "lora.alpha=16", "hardware=w1eval",
           f"train.micro_batch_size={MICRO_BATCH}", f"train.num_micro_batches={NUM_MICRO}", f"train.lr={LR}",
           f"data.path={data}", "data.format=tokens", "eval.device=localhost.cpu1", f"output={out / 'plan'}", cwd=out)
    plan = out / "plan" / "plan.json"
    on = [f"eval.every={every}", f"eval.path={held_out}", f"eval.max_batches={EVAL_BATCHES}"]
    times: dict[str, list[float]] = {"no eval": [], "eval": []}
    evals: list[EvalLine] = []
    for r in range(rounds):
        for name in (["no eval", "eval"] if r % 2 == 0 else ["eval", "no eval"]):
            t, lines = run(plan, out / f"run-{name.replace(' ', '-')}-{r}", steps, out, on if name == "eval" else [])
            times[name].append(t)
            evals = lines or evals
            print(f"  round {r}: {name}: {t:.3f} s/step" + (f", {len(lines)} eval_loss lines" if lines else ""),
                  flush=True)
    base, with_eval = statistics.median(times["no eval"]), statistics.median(times["eval"])
    return {"no_eval_s": base, "eval_s": with_eval, "ratio": with_eval / base, "evals": evals, "every": every,
            "steps": steps, "rounds": rounds}


def print_report(result: dict[str, Any]) -> None:
    ok = "yes" if result["ratio"] <= 1.05 else "NO"
    print(f"training step, median: without eval {result['no_eval_s']:.3f} s, with eval every {result['every']} "
          f"steps {result['eval_s']:.3f} s: {result['ratio']:.3f}x (within 5%: {ok})")
    for line in result["evals"]:
        print(f"  eval after step {line.step}: loss {line.eval_loss:.4f} on {line.eval_tokens} tokens "
              f"({line.eval_s or 0.0:.2f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-eval-"))
    out.mkdir(parents=True, exist_ok=True)
    print_report(bench(out.resolve(), args.steps, args.rounds, args.every))


if __name__ == "__main__":
    main()
