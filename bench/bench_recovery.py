"""Workload W1 losing a stage: how long the run takes to go on, and whether it still trains the same (issue 33).

    python bench/bench_recovery.py                   # ~ 8 minutes on 2 cores
    python bench/bench_recovery.py --steps 40 --kill-after 10 --stages 3

W1's model and data (bench_runtime.py) compiled once on ``--stages`` CPU stages x 1 thread, then run twice with the
defaults (runtime.elastic=auto):

- ``undisturbed``: the reference run;
- ``lost``: stage 1's process is SIGKILLed once step ``--kill-after`` is done; the run re-plans on the stages left
  and goes on from the state the coordinator copied off the stages.

Reported: the seconds from the kill to the next completed step (metrics.jsonl's recovery_s; target <= 30 s on this
machine), the steps trained again, and the largest difference of a step's loss between the two runs (target
<= 1e-5: the data of a step is a function of its number, so a recovered run trains what the undisturbed one did).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from w1_hetero import compile_hetero, hetero_cmd
from w1_model import prepare

from hetero.runtime.run.metrics_file import NAME, RunLines, read_metrics
from hetero.runtime.run.run_files import stage_pids

TARGET_S = 30.0
TARGET_LOSS = 1e-5


def _rows(run_dir: Path) -> RunLines:
    """The run's metrics.jsonl so far (a live run's: a line cut short is left for the next look)."""
    path = run_dir / NAME
    return read_metrics(path) if path.is_file() else RunLines([])


def _losses(rows: RunLines) -> dict[int, float]:
    """Step -> loss, the last line of each step (a step trained again replaces its earlier line)."""
    return {s.step: s.loss for s in rows.steps}


def _run(plan: Path, work: Path, name: str, kill_after: int | None) -> tuple[RunLines | None, str]:
    """One `hetero run` of ``plan``; with ``kill_after``, SIGKILL stage 1 once that step is done."""
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = hetero_cmd() + ["run", str(plan), "--run-dir", str(run_dir), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = kill_after is None
    deadline = time.monotonic() + 1800
    while proc.poll() is None and time.monotonic() < deadline:
        if not killed and any(s.step >= kill_after for s in _rows(run_dir).steps):
            os.kill(stage_pids(run_dir)[1], signal.SIGKILL)
            killed = True
            print(f"{name}: stage 1 SIGKILLed after step {kill_after}", flush=True)
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    if proc.returncode != 0:
        lines = (err or out).strip().splitlines()
        return None, f"`hetero run` failed: {lines[-1] if lines else proc.returncode}"
    return _rows(run_dir), ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W1: a stage lost mid-run")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-after", type=int, default=10, help="SIGKILL stage 1 once this step is done")
    ap.add_argument("--stages", type=int, default=3, help="CPU stages x 1 thread")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hetero-w1-recovery-"))
    try:
        model_dir, data = prepare(work, args.steps)
        plan, note = compile_hetero(model_dir, data, args.steps, work, stages=args.stages)
        if plan is None:
            print(f"UNAVAILABLE: {note}")
            return 1
        reference, note = _run(plan, work, "undisturbed", None)
        lost, lost_note = _run(plan, work, "lost", args.kill_after)
        if reference is None or lost is None:
            print(f"UNAVAILABLE: {note or lost_note}")
            return 1
        events = lost.recoveries
        if len(events) != 1:
            print(f"MISSED: {len(events)} recovery lines in metrics.jsonl, expected 1")
            return 1
        event = events[0]
        want, got = _losses(reference), _losses(lost)
        if sorted(got) != sorted(want) or len(want) != args.steps:
            print(f"MISSED: steps {sorted(got)} against {sorted(want)}")
            return 1
        worst = max(abs(got[s] - want[s]) for s in want)
        took = event.recovery_s if event.recovery_s is not None else float("nan")
        step_s = statistics.median(s.step_time_s for s in reference.steps)
        print(f"\nW1 on {args.stages} CPU stages x 1 thread, {args.steps} steps, stage 1 SIGKILLed after step "
              f"{args.kill_after} ({sys.platform}, median undisturbed step {step_s:.3f} s)")
        print(f"split {event.old_split} -> {event.new_split}; resumed from step {event.resumed_from_step} "
              f"({event.replayed_steps} step(s) trained again)")
        print(f"loss seen -> next completed step (a killed local stage is seen at once): {took:.1f} s (target <= {TARGET_S:g} s): "
              f"{'OK' if took <= TARGET_S else 'MISSED'}")
        print(f"largest per-step loss difference: {worst:.2e} (target <= {TARGET_LOSS:g}): "
              f"{'OK' if worst <= TARGET_LOSS else 'MISSED'}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
