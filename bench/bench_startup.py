"""Start-to-first-step of the README demo: this tree against a baseline commit, measured in one run.

    python bench/bench_startup.py [--baseline REF] [--repeats N]

The baseline is checked out into a temporary git worktree and installed (editable, no dependencies)
into a throwaway virtual environment that sees this machine's packages, so both trees run with the
same torch, transformers and peft. Each tree compiles the demo (`hetero compile model=tiny
hardware=local`) with its own code, then `hetero run plan.json train.steps=2` is timed from the
process start until metrics.jsonl holds its first step; the trees alternate so drift on a shared
machine hits both alike. The ratio is printed last. Do not run it beside other heavy work.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = "5ba9345"  # main before issue 21 (stages imported peft at start-up)
RUN_TIMEOUT_S = 300.0


def install_baseline(ref: str, work: Path) -> Path:
    """A venv (system packages visible) with ``ref`` installed editable in ``work/baseline``; returns its
    ``hetero`` command. Its commands run from that tree (``python -m`` puts the working directory first)."""
    tree = work / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref], check=True,
                   capture_output=True)
    venv = work / "venv"
    # No pip of its own: the machine's pip and setuptools (a venv's bundled setuptools is too old to build it).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                    str(tree)], check=True, capture_output=True)
    return venv / "bin" / "hetero"


def compile_demo(hetero: str, tree: Path, out: Path) -> Path:
    """The README's demo plan, compiled by ``hetero``'s own code from its repository root ``tree``."""
    subprocess.run([hetero, "compile", "model=tiny", "hardware=local", f"output={out}"], check=True,
                   capture_output=True, timeout=RUN_TIMEOUT_S, cwd=tree)
    return out / "plan.json"


def time_to_first_step(hetero: str, tree: Path, plan: Path, run_dir: Path) -> float:
    """Seconds from starting `hetero run` until its metrics.jsonl records a step; the run then finishes."""
    metrics = run_dir / "metrics.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen([hetero, "run", str(plan), "train.steps=2", "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tree)
    first = None
    while first is None and time.perf_counter() - start < RUN_TIMEOUT_S:
        if metrics.exists() and '"step"' in metrics.read_text():
            first = time.perf_counter() - start
        elif proc.poll() is not None:
            break
        time.sleep(0.02)
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"{hetero} run {plan} did not finish within {RUN_TIMEOUT_S:g} s") from None
    if first is None or proc.returncode != 0:
        raise SystemExit(f"{hetero} run {plan} failed (exit {proc.returncode}): {err.strip()[-500:]}")
    return first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git ref to compare with (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hetero-startup-"))
    try:
        trees = {"baseline": (str(install_baseline(args.baseline, work)), work / "baseline"),
                 "this tree": (shutil.which("hetero") or "hetero", REPO)}
        plans = {name: compile_demo(cmd, tree, work / f"demo-{i}")
                 for i, (name, (cmd, tree)) in enumerate(trees.items())}
        times: dict[str, list[float]] = {name: [] for name in trees}
        for r in range(args.repeats):
            for name, (cmd, tree) in trees.items():
                times[name].append(time_to_first_step(cmd, tree, plans[name], work / f"run-{name[:4]}-{r}"))
                print(f"  {name:<10} run {r + 1}: {times[name][-1]:.2f} s to the first step", flush=True)
        base, mine = (statistics.median(times[n]) for n in ("baseline", "this tree"))
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        print(f"\nstart-to-first-step, README demo (median of {args.repeats}, {os.cpu_count()} CPUs):")
        print(f"  baseline {args.baseline}: {base:.2f} s")
        print(f"  this tree ({head}): {mine:.2f} s")
        print(f"  ratio baseline / this tree: {base / mine:.2f}x")
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / "baseline")],
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
