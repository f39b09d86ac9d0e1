"""Workload W1 with every decoder layer streaming its frozen weights from host RAM vs none (issue 26).

    python bench/bench_offload.py              # ~ 3 minutes on 2 cores
    python bench/bench_offload.py --rounds 3 --steps 8
    python bench/bench_offload.py --profile    # predictions from `hetero profile` (measured copy rate)

The W1 model and run of bench_runtime.py (2 CPU stages x 1 thread, 1F1B, 8 micro-batches of 4 x 128
tokens, fp32, LoRA r=8 on all projections), compiled with planner.offload=none and =full (the host
declares ram_gb so that it may stream) and run alternately (rounds), so a drifting machine slows both
alike. Reported per setting: the median step time over steps 3..N of each run and over rounds, the
plan's predicted step time, and the bytes each run streamed per step against the plan's figure; then
the measured full / none ratio beside the predicted one.

On a CPU "device" host RAM and device memory are the same RAM: streaming saves nothing here and
costs a copy of each frozen weight per use. What this measures is that cost and whether the plan
prices it: the measured ratio should match the predicted one. With ``--profile`` the plans are compiled
from a `hetero profile` of the same fleet (layer times and the host link measured: the runtime's own copy)
instead of the datasheet roofline.
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

from hetero.runtime.run.metrics_file import NAME, read_metrics

RAM_GB = 8.0  # what the bench's host declares for streamed weights (W1's frozen weights are ~20 MB)


def streamed_per_step(run_dir: Path) -> float:
    """Median over steps 3..N of the bytes all stages streamed per step (0 where metrics carry none)."""
    per_step = [sum(b or 0 for b in s.stage_streamed_bytes or [0]) for s in read_metrics(run_dir / NAME).steps]
    return median_tail([float(x) for x in per_step]) if per_step else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W1: offload=full vs none")
    ap.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--profile", action="store_true", help="compile from a `hetero profile` of the fleet")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hetero-w1-offload-"))
    try:
        model_dir, data = prepare(work, args.steps)
        costs: tuple[str, ...] = ()
        if args.profile:
            profile, note = compile_hetero(model_dir, data, args.steps, work, ram_gb=RAM_GB, verb="profile",
                                           name="profile")
            if profile is None:
                print(f"profile: UNAVAILABLE: {note}")
                return 1
            link = [d.get("host_link_gbs") for d in json.loads(profile.read_text())["devices"]]
            print(f"profiled: host link {', '.join(f'{x:.2f}' for x in link if x)} GB/s", flush=True)
            costs = (f"profile={profile}",)
        times: dict[str, list[float]] = {"none": [], "full": []}
        streamed: dict[str, list[float]] = {"none": [], "full": []}
        predicted: dict[str, tuple[float, float]] = {}
        for r in range(args.rounds):
            for mode in ("none", "full"):
                plan, note = compile_hetero(model_dir, data, args.steps, work, ("planner.offload=" + mode, *costs),
                                            ram_gb=RAM_GB)
                got, note = run_plan(plan, args.steps, work) if plan is not None else (None, note)
                if got is None:
                    print(f"offload={mode}: UNAVAILABLE: {note}")
                    return 1
                doc = json.loads(plan.read_text())  # type: ignore[union-attr]
                stages = doc["stages"]
                assert all(bool(s["stream_layers"]) == (mode == "full") for s in stages), "plan ignored the mode"
                predicted[mode] = (doc["prediction"]["step_time_s"],
                                   sum(s["streamed_bytes_per_step"] for s in stages))
                times[mode].append(median_tail(got))
                streamed[mode].append(streamed_per_step(work / "run"))
                print(f"round {r + 1} offload={mode:<5} step {times[mode][-1]:.3f} s, streamed "
                      f"{streamed[mode][-1] / 1e6:.1f} MB/step", flush=True)
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"\n{'offload':<9}{'step s':>9}{'predicted':>11}{'MB/step':>10}{'predicted MB':>14}")
        for m in ("none", "full"):
            print(f"{m:<9}{med[m]:>9.3f}{predicted[m][0]:>11.3f}{statistics.median(streamed[m]) / 1e6:>10.1f}"
                  f"{predicted[m][1] / 1e6:>14.1f}")
        print(f"\nfull / none step time: {med['full'] / med['none']:.3f}x measured, "
              f"{predicted['full'][0] / predicted['none'][0]:.3f}x predicted; per-round ratios "
              + ", ".join(f"{f / n:.3f}" for f, n in zip(times["full"], times["none"], strict=True)))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
