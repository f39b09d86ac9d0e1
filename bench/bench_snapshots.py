"""Workload W1 with and without the run's own snapshots: what keeping a run recoverable costs (issue 33).

    python bench/bench_snapshots.py            # ~ 10 minutes on 2 cores
    python bench/bench_snapshots.py --rounds 3 --steps 40

W1's model and data (bench_runtime.py) compiled once on 2 CPU stages x 1 thread (``--stages``), then run alternately (rounds,
so a drifting machine slows every setting alike) in three settings:

- ``off``: no snapshot at all (runtime.elastic=off runtime.snapshot_every_s=0), the reference;
- ``default``: what a run does unless told otherwise: the stages' state copied to the coordinator's memory every
  few steps (runtime.elastic=auto) and to disk every runtime.snapshot_every_s (900 s: not within this run);
- ``disk every 2 s``: the default with a disk snapshot every 2 s of training, far more often than the default.

Reported per setting: the mean step time over steps 3..N (a mean, not a median: a snapshot costs one step in
several, which a median would hide) and its ratio to ``off``. The target: default / off <= 1.03.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from w1_hetero import compile_hetero, run_plan
from w1_model import prepare

TARGET = 1.03
SETTINGS = {
    "off": ("runtime.elastic=off", "runtime.snapshot_every_s=0"),
    "default": (),
    "disk every 2 s": ("runtime.snapshot_every_s=2",),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W1: snapshots on vs off")
    ap.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run (mean over 3..N)")
    ap.add_argument("--stages", type=int, default=2, help="CPU stages x 1 thread (2: one per core, the least noise)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hetero-w1-snapshots-"))
    try:
        model_dir, data = prepare(work, args.steps)
        plan, note = compile_hetero(model_dir, data, args.steps, work, stages=args.stages)
        if plan is None:
            print(f"UNAVAILABLE: {note}")
            return 1
        means: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for r in range(args.rounds):
            for name, run_args in SETTINGS.items():
                got, note = run_plan(plan, args.steps, work, run_args=run_args)
                if got is None:
                    print(f"{name}: UNAVAILABLE: {note}")
                    return 1
                means[name].append(statistics.fmean(got[2:]))
                print(f"round {r + 1} {name:<15} mean step {means[name][-1]:.4f} s", flush=True)
        base = statistics.median(means["off"])
        print(f"\n{'setting':<16}{'mean step s':>12}{'/ off':>8}")
        for name, values in means.items():
            print(f"{name:<16}{statistics.median(values):>12.4f}{statistics.median(values) / base:>8.3f}")
        ratio = statistics.median(means["default"]) / base
        print(f"\ndefault / off: {ratio:.3f}x (target <= {TARGET}x): {'OK' if ratio <= TARGET else 'MISSED'}; "
              "per-round ratios " + ", ".join(f"{d / o:.3f}" for d, o in zip(means["default"], means["off"], strict=True)))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
