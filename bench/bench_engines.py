"""W1 on both engines: the same compiled plan run by hetero's engine and by `--engine torch`, alternating.

`hetero run plan.json` (hetero's ZeroMQ runtime) and `hetero run plan.json --engine torch`
(torch.distributed.pipelining, gloo) train W1's model on this machine's CPU stages, one thread each. Each
round runs both, in alternating order, so a drift of this shared machine falls on both alike; the figure
is the median step over steps 3..N of each run, and the ratio torch / hetero per round and over all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from w1_hetero import compile_hetero, run_plan  # noqa: E402
from w1_model import MICRO_BATCH, SEQ_LEN, median_tail, prepare  # noqa: E402

ENGINES = ("hetero", "torch")


def measure(plan: Path, steps: int, rounds: int, work: Path) -> dict[str, list[float]]:
    """Per engine, the median step seconds of each round (engines alternate which goes first)."""
    medians: dict[str, list[float]] = {e: [] for e in ENGINES}
    for r in range(rounds):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            times, note = run_plan(plan, steps, work, engine=engine)
            if times is None:
                raise SystemExit(f"{engine}: {note}")
            medians[engine].append(median_tail(times))
            print(f"  round {r + 1} {engine:6s} {medians[engine][-1]:.3f} s/step", flush=True)
    return medians


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W1: hetero's engine vs --engine torch on the same plan (CPU)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hetero-engines-"))
    try:
        print(f"W1 on both engines: micro-batches of {MICRO_BATCH} x {SEQ_LEN} tokens, m={args.micro_batches}, "
              f"{args.steps} steps per run; torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
        model_dir, data = prepare(work, args.steps, args.micro_batches)
        for stages in args.stages:
            plan, note = compile_hetero(model_dir, data, args.steps, work, stages=stages, num_micro=args.micro_batches,
                                        name=f"plan-{stages}")
            if plan is None:
                print(f"S={stages}: {note}")
                continue
            print(f"S={stages}:", flush=True)
            medians = measure(plan, args.steps, args.rounds, work)
            ratios = [t / h for t, h in zip(medians["torch"], medians["hetero"], strict=True)]
            print(f"S={stages} m={args.micro_batches}: hetero {statistics.median(medians['hetero']):.3f} s/step, "
                  f"torch {statistics.median(medians['torch']):.3f} s/step; torch / hetero "
                  f"{statistics.median(ratios):.2f}x (rounds {' '.join(f'{x:.2f}' for x in ratios)})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
