"""Workload W1 as interleaved 1F1B (two chunks per device) vs one chunk per device (issue 36).

    python bench/bench_interleave.py              # ~ 5 minutes on 2 cores
    python bench/bench_interleave.py --rounds 3 --steps 10 --micro 4

The W1 model and run of bench_runtime.py (2 CPU stages x 1 thread, fp32, LoRA r=8 on all projections,
micro-batches of 4 x 128 tokens), profiled once with `hetero profile`, then compiled from that profile with
planner.interleave=off and =always, and run alternately (rounds), so a drifting machine slows both alike.
Reported per setting: the median step over steps 3..N of each run and over rounds, the plan's predicted
step, and measured / predicted (the target: within 10 %); then the measured always / off ratio beside the
predicted one, and what planner.interleave=auto plans for this fleet.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from w1_hetero import compile_hetero, run_plan
from w1_model import median_tail, prepare


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W1: interleaved 1F1B vs one chunk per device")
    ap.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step (a multiple of the 2 devices)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hetero-w1-interleave-"))
    try:
        model_dir, data = prepare(work, args.steps)
        profile, note = compile_hetero(model_dir, data, args.steps, work, num_micro=args.micro, verb="profile",
                                       name="profile")
        if profile is None:
            print(f"profile: UNAVAILABLE: {note}")
            return 1
        costs = (f"profile={profile}",)
        times: dict[str, list[float]] = {"off": [], "always": []}
        predicted: dict[str, float] = {}
        for r in range(args.rounds):
            for mode in ("off", "always"):
                plan, note = compile_hetero(model_dir, data, args.steps, work, ("planner.interleave=" + mode, *costs),
                                            num_micro=args.micro, name=f"plan-{mode}")
                got, note = run_plan(plan, args.steps, work) if plan is not None else (None, note)
                if got is None:
                    print(f"interleave={mode}: UNAVAILABLE: {note}")
                    return 1
                doc = json.loads(plan.read_text())  # type: ignore[union-attr]
                assert all(bool(s.get("chunks")) == (mode == "always") for s in doc["stages"]), "plan ignored the mode"
                predicted[mode] = doc["prediction"]["step_time_s"]
                times[mode].append(median_tail(got))
                print(f"round {r + 1} interleave={mode:<6} step {times[mode][-1]:.3f} s (predicted "
                      f"{predicted[mode]:.3f} s)", flush=True)
        auto, note = compile_hetero(model_dir, data, args.steps, work, ("planner.interleave=auto", *costs),
                                    num_micro=args.micro, name="plan-auto")
        said = "?"
        if auto is not None:
            doc = json.loads(auto.read_text())
            said = next((v for v in doc["verdict"] if "nterleave" in v), "no interleaving line")
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"\n{'interleave':<12}{'step s':>9}{'predicted':>11}{'measured/predicted':>20}")
        for m in ("off", "always"):
            print(f"{m:<12}{med[m]:>9.3f}{predicted[m]:>11.3f}{med[m] / predicted[m]:>20.3f}")
        print(f"\nalways / off step time: {med['always'] / med['off']:.3f}x measured, "
              f"{predicted['always'] / predicted['off']:.3f}x predicted; per-round ratios "
              + ", ".join(f"{a / o:.3f}" for a, o in zip(times["always"], times["off"], strict=True)))
        print(f"planner.interleave=auto on this fleet: {said}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
