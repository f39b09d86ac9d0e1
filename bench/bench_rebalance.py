"""W5 (shared/BENCHMARKS.md): a device that slows down mid-run, with and without rebalancing.

`python -m bench rebalance` (root, cgroup v1 cpu controller or cgroup v2 cpu.max). W1's model, data and
plan on 2 CPU stage processes x 1 thread, 1F1B, 36 steps; after step 6, stage 0's process is put in a
cgroup with a CPU quota of 30 % of one core (a card that throttles, or is taken by a game): the same
process stays in the run. Three runs in one script, each with the same slowdown:

  off     `hetero run plan.json runtime.rebalance=off`  (the plan's split to the end)
  auto    `hetero run plan.json`                        (runtime.rebalance=auto, the default; an interleaved
          plan is re-planned and its stages restarted: the slowed device's new process is throttled too)
  fresh   a plan compiled for the slowed fleet: stage 0's device priced at the speed the `off` run measured
          after the slowdown (its datasheet numbers scaled by it), run with rebalance off

`--shape replicas` trains two one-stage replicas instead, `--shape streamed` a plan that streams every decoder
layer's frozen weights from host RAM (planner.offload=full; the fresh plan streams too).

Reports the median of the last 8 step times of each, auto/off and auto/fresh, when the move happened and
what it moved, and the largest per-step loss difference between the runs (they must agree within 1e-5).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hetero.errors import ConfigError
from hetero.runtime.run.metrics_file import NAME, read_metrics
from hetero.runtime.run.run_files import stage_pids
from hetero.runtime.run.run_segments import compute_s

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

STEPS, SLOW_AFTER, QUOTA, TAIL = 36, 6, 0.30, 8
SLOW_DEVICE = "localhost.cpu0"  # the device that slows down: stage 0 of W1's plan (the fresh plan may order it last)
CPU_TFLOPS, CPU_BANDWIDTH = 0.112, 51.2  # hardware_specs/cpu.yaml's datasheet numbers, scaled for `fresh`


class Throttle:
    """A cgroup that gives its processes ``quota`` of one core (v1 cpu.cfs_quota_us, or v2 cpu.max)."""

    def __init__(self, name: str, quota: float) -> None:
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        period = 100_000
        if (v1 / "cpu.cfs_quota_us").exists():
            self.root, self.path = v1, v1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(int(quota * period)))
        elif (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            self.root, self.path = v2, v2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{int(quota * period)} {period}")
        else:
            raise RuntimeError("no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 cpu.max) to slow a stage")

    def add(self, pid: int) -> None:
        """Put every thread of process ``pid`` under the quota."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Give the processes back to the root group and remove the cgroup."""
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # it exited meanwhile
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _stage_pid(run_dir: Path, k: int) -> int | None:
    try:
        return stage_pids(run_dir).get(k)
    except ConfigError:  # not written yet, or being written
        return None


def slow_stage(plan: Path) -> int:
    """The stage of ``plan`` that runs on SLOW_DEVICE."""
    return next(s["index"] for s in json.loads(plan.read_text())["stages"] if s["device"] == SLOW_DEVICE)


def run_slowed(plan: Path, work: Path, name: str, rebalance: str) -> dict[str, Any]:
    """`hetero run` of ``plan``, SLOW_DEVICE's stage throttled once step SLOW_AFTER is done; step times, losses,
    moves."""
    from w1_hetero import hetero_cmd

    slow = slow_stage(plan)
    run_dir = work / f"run-{name}"
    cmd = hetero_cmd() + ["run", str(plan), "--run-dir", str(run_dir), "--no-progress", f"runtime.rebalance={rebalance}"]
    throttle = Throttle(f"hetero-w5-{os.getpid()}-{name}", QUOTA)
    log = (work / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    slowed_at, throttled = None, set()
    try:
        deadline = time.monotonic() + 1800
        while proc.poll() is None and time.monotonic() < deadline:
            steps = read_metrics(run_dir / NAME).steps if (run_dir / NAME).is_file() else []  # a live run's lines
            if slowed_at is None and len(steps) > SLOW_AFTER and (pid := _stage_pid(run_dir, slow)) is not None:
                throttle.add(pid)
                throttled.add(pid)
                slowed_at = len(steps) - 1
            elif slowed_at is not None and (pid := _stage_pid(run_dir, slow)) is not None and pid not in throttled:
                # A re-plan move (runtime/run/replan_moves.py) restarts the stages: the device stays slow, so its
                # new process is throttled too (a card that throttles does so whichever process drives it). The
                # re-plan keeps the devices' order, so the slow device's stage keeps its index.
                throttle.add(pid)
                throttled.add(pid)
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    finally:
        throttle.close()
        log.close()
    rows = read_metrics(run_dir / NAME)
    steps = rows.steps
    if proc.returncode != 0 or len(steps) != STEPS:
        tail = (work / f"{name}.log").read_text().strip().splitlines()[-1:] or ["?"]
        raise RuntimeError(f"{name}: `hetero run` exit {proc.returncode}, {len(steps)} steps: {tail[0]}")
    times = [s.step_time_s for s in steps]
    return {"name": name, "times": times, "losses": [s.loss for s in steps], "slowed_after": slowed_at,
            "tail_s": statistics.median(times[-TAIL:]), "moves": rows.moves,
            "stage_ops": [s.stage_ops for s in steps], "split": steps[-1].split, "slow_stage": slow}


def measured_slowdown(run: dict[str, Any]) -> float:
    """The slowed stage's F + B per step at the end of a run against before its slowdown (steps 2..SLOW_AFTER)."""
    k = run["slow_stage"]

    before = statistics.median(compute_s(o[k]) for o in run["stage_ops"][2:SLOW_AFTER + 1])
    after = statistics.median(compute_s(o[k]) for o in run["stage_ops"][-TAIL:])
    return after / before


def fresh_plan(model_dir: Path, data: Path, work: Path, slowdown: float, shape: str = "default") -> Path:
    """W1 compiled for the slowed fleet: device 0's compute and memory bandwidth divided by ``slowdown`` (the
    planner chooses the plan's shape, within what ``shape`` keeps: FRESH_EXTRA)."""
    from w1_hetero import compile_hetero

    fleet = ("name: w1\nhosts:\n  - name: localhost\n    address: 127.0.0.1\n    port: {port}{host_extra}\n    devices:\n"
             f"      - {{{{type: cpu, count: 1, threads: 1, tflops_fp32: {CPU_TFLOPS / slowdown:.5g}, "
             f"memory_bandwidth_gbs: {CPU_BANDWIDTH / slowdown:.5g}}}}}\n"
             "      - {{type: cpu, count: 1, threads: 1}}\n")
    import w1_hetero

    saved = w1_hetero.HARDWARE_YAML
    w1_hetero.HARDWARE_YAML = fleet
    try:
        plan, note = compile_hetero(model_dir, data, STEPS, work / "fresh", name="plan-fresh",
                                    extra=FRESH_EXTRA.get(shape, ()), ram_gb=HOST_RAM_GB.get(shape))
    finally:
        w1_hetero.HARDWARE_YAML = saved
    if plan is None:
        raise RuntimeError(note)
    return plan


# The plan the off and auto runs train: W1's (which interleaves), two one-stage replicas, or every decoder layer
# streaming its frozen weights from host RAM (the host sets 1 GB aside for them; W1's 8 layers are 23 MB).
SHAPES: dict[str, tuple[str, ...]] = {"default": (), "replicas": ("planner.replicas=2", "planner.num_stages=null"),
                                      "streamed": ("planner.offload=full",)}
HOST_RAM_GB = {"streamed": 1.0}  # hardware.hosts[].ram_gb per shape (none: the host streams nothing)
FRESH_EXTRA = {"streamed": SHAPES["streamed"]}  # what the fresh plan keeps of the shape (a user's own constraint)


def run_w5(work: Path, log: Any = print, shape: str = "default") -> dict[str, Any]:
    """The three runs; the figures W5 reports. ``shape``: the plan the off and auto runs train (SHAPES: the
    planner's default, which interleaves, or two one-stage replicas)."""
    from w1_hetero import compile_hetero, plan_split
    from w1_model import prepare

    model_dir, data = prepare(work, STEPS)
    plan, note = compile_hetero(model_dir, data, STEPS, work, extra=SHAPES[shape], ram_gb=HOST_RAM_GB.get(shape))
    if plan is None:
        raise RuntimeError(note)
    runs = {}
    for name, mode in (("off", "off"), ("auto", "auto")):
        runs[name] = run_slowed(plan, work, name, mode)
        log(f"{name}: last {TAIL} steps median {runs[name]['tail_s']:.3f} s, split at the end {runs[name]['split']}")
    slowdown = measured_slowdown(runs["off"])
    fresh = fresh_plan(model_dir, data, work, slowdown, shape)
    runs["fresh"] = run_slowed(fresh, work, "fresh", "off")
    log(f"fresh (split {plan_split(fresh)}, {SLOW_DEVICE} as stage {slow_stage(fresh)}, for it {slowdown:.2f}x "
        f"slower): last {TAIL} steps median "
        f"{runs['fresh']['tail_s']:.3f} s")
    diff = max(abs(a - b) for r in ("auto", "fresh") for a, b in zip(runs["off"]["losses"], runs[r]["losses"],
                                                                      strict=True))
    return {"plan_split": plan_split(plan), "fresh_split": plan_split(fresh), "slowdown": slowdown,
            "fresh_slow_stage": slow_stage(fresh),
            "runs": {k: {key: v for key, v in r.items() if key != "stage_ops"} for k, r in runs.items()},
            "auto_over_off": runs["off"]["tail_s"] / runs["auto"]["tail_s"],
            "auto_over_fresh": runs["fresh"]["tail_s"] / runs["auto"]["tail_s"], "max_loss_diff": diff}


def lines(result: dict[str, Any]) -> list[str]:
    """The W5 table a person reads (markdown)."""
    runs = result["runs"]
    out = [f"W5: {STEPS} steps, {SLOW_DEVICE}'s stage limited to {QUOTA:.0%} of a core after step {SLOW_AFTER} "
           f"(measured {result['slowdown']:.2f}x slower); plan split {result['plan_split']}; the fresh plan puts "
           f"{SLOW_DEVICE} at stage {result['fresh_slow_stage']}", "",
           "| run | split at the end | median of the last 8 steps (s) | moves |", "|---|---|---|---|"]
    for name in ("off", "auto", "fresh"):
        r = runs[name]
        moves = "; ".join(f"after step {m.after_step}: {m.old_split} -> {m.new_split} (predicted "
                          f"{m.predicted_gain or 0.0:.2f}x, moved in {m.move_s or 0.0:.2f} s)" for m in r["moves"]) or "none"
        out.append(f"| {name} | {r['split']} | {r['tail_s']:.3f} | {moves} |")
    out += ["", f"auto / off: **{result['auto_over_off']:.2f}x** faster (target >= 1.4); auto / fresh plan: "
            f"{result['auto_over_fresh']:.2f}x; largest per-step loss difference between the runs: "
            f"{result['max_loss_diff']:.2e} (target <= 1e-5)"]
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench rebalance [--shape replicas|streamed]`."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench rebalance")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default",
                        help="the plan the off and auto runs train (default: the planner's, which interleaves; "
                             "replicas: two one-stage replicas; streamed: planner.offload=full)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetero-w5-") as tmp:
        result = run_w5(Path(tmp), log=lambda s: print("  " + s, flush=True), shape=args.shape)
    print("\n".join(lines(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
