"""Workload W1 with every decoder layer recomputing vs none: what recomputation costs in time and saves in memory.

    python bench/bench_recompute.py            # ~ 3 minutes on 2 cores
    python bench/bench_recompute.py --rounds 3 --steps 8

The W1 model and run of bench_runtime.py (2 CPU stages x 1 thread, 1F1B, 8 micro-batches of 4 x 128
tokens, fp32, LoRA r=8 on all projections), compiled with planner.recompute=none and =full and run
alternately (rounds), so a drifting machine slows both alike. Reported per setting: the median step
time over steps 3..N of each run, the median over rounds, the largest stage process's peak RSS, and
the plan's predicted step time and stage-0 activation memory. The target: full / none <= 1.35x
(each recomputed layer adds one forward, ~1/3 of its forward + backward).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from w1_hetero import run_hetero
from w1_model import median_tail, prepare

TARGET = 1.35


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W1: recompute=full vs none")
    ap.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (median over 3..N)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hetero-w1-recompute-"))
    try:
        model_dir, data = prepare(work, args.steps)
        times: dict[str, list[float]] = {"none": [], "full": []}
        rss: dict[str, list[float]] = {"none": [], "full": []}
        predicted: dict[str, tuple[float, float]] = {}
        for r in range(args.rounds):
            for mode in ("none", "full"):
                peak: dict[str, float] = {}
                got, note = run_hetero(model_dir, data, args.steps, work, ("planner.recompute=" + mode,), peak)
                if got is None:
                    print(f"recompute={mode}: UNAVAILABLE: {note}")
                    return 1
                times[mode].append(median_tail(got))
                rss[mode].append(peak.get("rss_mib", float("nan")))
                plan = json.loads((work / "plan" / "plan.json").read_text())
                stages = plan["stages"]
                assert all(bool(s["recompute_layers"]) == (mode == "full") for s in stages)
                predicted[mode] = (plan["prediction"]["step_time_s"], stages[0]["memory"]["activations_gb"])
                print(f"round {r + 1} recompute={mode:<5} step {times[mode][-1]:.3f} s, peak RSS "
                      f"{rss[mode][-1]:.0f} MiB", flush=True)
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"\n{'recompute':<10}{'step s':>9}{'predicted':>11}{'peak RSS MiB':>14}{'stage-0 acts MB':>17}")
        for m in ("none", "full"):
            print(f"{m:<10}{med[m]:>9.3f}{predicted[m][0]:>11.3f}{max(rss[m]):>14.0f}{predicted[m][1] * 1e3:>17.1f}")
        ratio = med["full"] / med["none"]
        print(f"\nfull / none step time: {ratio:.3f}x measured, {predicted['full'][0] / predicted['none'][0]:.3f}x "
              f"predicted (target <= {TARGET}x): {'OK' if ratio <= TARGET else 'MISSED'}")
        print(f"peak RSS full / none: {max(rss['full']) / max(rss['none']):.3f}x; per-round ratios "
              + ", ".join(f"{f / n:.3f}" for f, n in zip(times["full"], times["none"], strict=True)))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
