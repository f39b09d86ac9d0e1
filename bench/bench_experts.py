"""Mixtures of experts on 3 CPU stages (issue 38): grouped experts against transformers' per-expert loop, and
measured / predicted step after `hetero profile`.

    python bench/bench_experts.py                 # ~ 25 minutes on 2 cores
    python bench/bench_experts.py --families qwen3_moe --rounds 1

Per family, a random-init model of W6's sizes (hidden 256, 8 layers, 8 heads / 4 KV heads of 32, vocab 2048,
fp32, seq 128, LoRA r=8 on attention) with the expert shape of the checkpoint people train, scaled to hidden 256:
- qwen3_moe: Qwen3-30B-A3B's 128 experts, top-8, each of intermediate 96 (768 / 2048 of the hidden size);
- mixtral: Mixtral 8x7B's 8 experts, top-2, each of intermediate 896 (14336 / 4096).
It is compiled onto 3 local CPU stages x 1 thread (8 micro-batches of 4) and run with
`model.experts_implementation=eager` (the loop: a host sync and ~10 kernels per expert) and `grouped` (the
default), alternating in ``--rounds`` rounds because this machine's speed drifts. Each grouped round also runs
`hetero profile` and the plan compiled from it. Reported: median step over steps 3..N, eager / grouped, and
measured / predicted for the datasheet plan and the profiled one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_families import architecture  # noqa: E402
from w1_hetero import compile_hetero, run_plan  # noqa: E402
from w1_model import median_tail, prepare  # noqa: E402

from hetero.families import family  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"moe_intermediate_size": 96, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 896, "num_local_experts": 8, "num_experts_per_tok": 2},
}


def _one(model_dir: Path, data: Path, steps: int, work: Path, extra: tuple[str, ...], name: str
         ) -> tuple[float, float] | str:
    """(measured median step, predicted step) of one compile + run, or why not."""
    plan, note = compile_hetero(model_dir, data, steps, work, extra, stages=3, name=name)
    if plan is None:
        return note
    predicted = float(json.loads(plan.read_text())["prediction"]["step_time_s"])
    times, note = run_plan(plan, steps, work)
    return note if times is None else (median_tail(times), predicted)


def bench_family(model_type: str, steps: int, rounds: int, work: Path) -> dict[str, Any]:
    fam_dir = work / model_type
    fam_dir.mkdir()
    model_dir, data = prepare(fam_dir, steps, architecture={**architecture(model_type), **SHAPES[model_type]})
    lora = (f"lora.target_modules=[{','.join(family(model_type).lora_targets_of(architecture(model_type)))}]",)
    got: dict[str, list[tuple[float, float]]] = {"eager": [], "grouped": [], "profiled": []}
    for r in range(rounds):
        for impl in ("eager", "grouped"):
            one = _one(model_dir, data, steps, fam_dir, (*lora, f"model.experts_implementation={impl}"), f"{impl}{r}")
            if isinstance(one, str):
                return {"family": model_type, "note": one}
            got[impl].append(one)
            print(f"  {model_type} round {r} {impl}: {one[0]:.3f} s/step (predicted {one[1]:.3f})", flush=True)
        profile, note = compile_hetero(model_dir, data, steps, fam_dir, lora, stages=3, name=f"profile{r}",
                                       verb="profile")
        if profile is None:
            return {"family": model_type, "note": note}
        one = _one(model_dir, data, steps, fam_dir, (*lora, f"profile={profile}"), f"profiled{r}")
        if isinstance(one, str):
            return {"family": model_type, "note": one}
        got["profiled"].append(one)
        print(f"  {model_type} round {r} grouped, profiled: {one[0]:.3f} s/step (predicted {one[1]:.3f})", flush=True)
    row: dict[str, Any] = {"family": model_type}
    for key, runs in got.items():
        row[key] = statistics.median(m for m, _ in runs)
        row[f"{key}_ratio"] = statistics.median(m / p for m, p in runs)
    row["speedup"] = statistics.median(e / g for (e, _), (g, _) in zip(got["eager"], got["grouped"], strict=True))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="MoE on 3 CPU stages: grouped vs eager experts, profiled prediction")
    ap.add_argument("--families", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of eager and grouped")
    args = ap.parse_args(argv)
    names = args.families.split(",")
    if any(n not in SHAPES for n in names):
        print(f"unknown families in {names}; benchmarked: {', '.join(SHAPES)}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="hetero-moe-"))
    try:
        rows = [bench_family(n, args.steps, args.rounds, work) for n in names]
        print(f"\n{'family':<11}{'eager s':>9}{'grouped s':>11}{'eager/grouped':>15}{'eager meas/pred':>17}"
              f"{'grouped meas/pred':>19}{'profiled s':>12}{'profiled meas/pred':>20}")
        for r in rows:
            if "note" in r:
                print(f"{r['family']:<11}UNAVAILABLE: {r['note']}")
                continue
            print(f"{r['family']:<11}{r['eager']:>9.3f}{r['grouped']:>11.3f}{r['speedup']:>14.2f}x"
                  f"{r['eager_ratio']:>17.2f}{r['grouped_ratio']:>19.2f}{r['profiled']:>12.3f}"
                  f"{r['profiled_ratio']:>20.2f}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
