"""Workload W1 (/work/shared/BENCHMARKS.md): the hetero runtime against its peer and baselines on this CPU.

    python bench/bench_runtime.py                          # 2 and 3 stages x 4, 8, 16 micro-batches, ~8 min
    python bench/bench_runtime.py --stages 2 --micro-batches 8 --rounds 3

Model: random-init Llama (hidden 256, 8 layers, 8 heads, 4 KV heads, intermediate 688, vocab 2048,
untied head), seq 128, fp32, sdpa; LoRA r=8 alpha 16 on q,k,v,o,gate,up,down; AdamW lr 1e-3;
micro-batches of 4 sequences (m = 8: 4096 tokens per step). Every run trains the same model on the
same token stream, measured in this one script run:

  one-process-1t    all micro-batches in one process (stock peft), 1 thread
  one-process-2t    the same with 2 threads (the best one device can do here)
  torch-pipelining  the peer: torch.distributed.pipelining, manual stages (even split, remainder to
                    the front), Schedule1F1B, gloo, S processes x 1 thread, stock peft LoRA
  hetero            `hetero compile` + `hetero run` (S CPU stages x 1 thread over ZeroMQ loopback)

hetero and the peer run alternately (``--rounds`` pairs per setting, the first of each pair
swapped every round), so a drifting machine slows both alike; a setting's figure is the median
over its rounds of each run's median step time over steps 3..N. Bounds: the classic balanced bound
(one-process-1t / S x (m+S-1)/m) and the honest one at layer granularity (per-node forward+backward
times measured alone with hetero's kernels, the best contiguous split's slowest stage x (m+S-1),
plus the optimizer step); with more stages than cores the bound is also at least the total work
divided by the cores. hetero's own metrics (stage_ops) say where each stage's step goes.

This file runs the settings and reports; the parts: w1_model.py (the model, data and step, shared by
every benchmark), w1_peer.py (the peer), w1_bounds.py (one-process baselines, the layer bound),
w1_hetero.py (`hetero compile` / `hetero run`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from w1_bounds import layer_bound, node_times, one_process_in_child  # noqa: E402
from w1_hetero import compile_hetero, plan_split, run_plan  # noqa: E402
from w1_model import MICRO_BATCH, NUM_MICRO, SEQ_LEN, median_tail, prepare  # noqa: E402
from w1_peer import check_split, even_counts, run_pipelining  # noqa: E402


def run_w1(work: Path, stage_counts: tuple[int, ...] = (2, 3), micro_batches: tuple[int, ...] = (4, 8, 16),
           steps: int = 5, rounds: int = 2, extra_rounds_at: int = 8, baselines: bool = True,
           log: Any = print) -> dict[str, Any]:
    """Run W1 over every (stages, micro-batches) setting; returns {"rows": [...], "baselines": {...}}.

    hetero and the peer alternate; settings with m == ``extra_rounds_at`` get ``rounds`` pairs, the
    others one pair. Rows carry the step times, the bounds and hetero's per-stage ops."""
    cores = os.cpu_count() or 1
    model_dir, data = prepare(work, steps, max(micro_batches))
    result: dict[str, Any] = {"rows": [], "baselines": {}, "cores": cores, "steps": steps,
                              "torch": torch.__version__}
    node_s, opt_s = node_times(model_dir)
    result["node_times_s"], result["opt_s"] = node_s, opt_s
    log("per-node F+B per micro-batch (hetero kernels, alone): " + ", ".join(f"{t * 1e3:.0f}" for t in node_s)
        + f" ms; optimizer {opt_s * 1e3:.0f} ms")
    for stages in stage_counts:
        counts = even_counts(stages)
        split_err = check_split(model_dir, counts)
        for m in micro_batches:
            plan, note = compile_hetero(model_dir, data, steps, work, stages=stages, num_micro=m, name=f"plan-{stages}-{m}")
            row: dict[str, Any] = {"stages": stages, "m": m, "tokens_per_step": SEQ_LEN * MICRO_BATCH * m,
                                   "peer_split": counts, "peer_split_err": split_err, "hetero": [], "peer": []}
            if plan is None:
                row["note"] = note
                log(f"S={stages} m={m}: hetero UNAVAILABLE: {note}")
            else:
                row["hetero_split"] = plan_split(plan)
                row["predicted_s"] = json.loads(plan.read_text())["prediction"]["step_time_s"]
            bound, bound_split = layer_bound(node_s, opt_s, stages, m, cores)
            row["layer_bound_s"], row["layer_bound_split"] = bound, bound_split
            pairs = rounds if m == extra_rounds_at else 1
            for r in range(pairs):
                order = ("hetero", "peer") if r % 2 == 0 else ("peer", "hetero")
                for who in order:
                    if who == "peer":
                        row["peer"].append(median_tail(run_pipelining(model_dir, data, steps, work, counts, m)))
                    elif plan is not None:
                        detail: dict[str, Any] = {}
                        times, note = run_plan(plan, steps, work, detail=detail)
                        if times is None:
                            row["note"] = note
                            log(f"S={stages} m={m}: hetero failed: {note}")
                            continue
                        row["hetero"].append(median_tail(times))
                        row["stage_ops"] = detail.get("stage_ops")
                    log(f"S={stages} m={m} round {r + 1} {who}: {row[who][-1]:.3f} s/step" if row[who] else "")
            for who in ("hetero", "peer"):
                row[f"{who}_s"] = statistics.median(row[who]) if row[who] else None
            if row["hetero_s"] and row["peer_s"]:
                row["speedup"] = row["peer_s"] / row["hetero_s"]
                row["of_layer_bound"] = row["layer_bound_s"] / row["hetero_s"]
            result["rows"].append(row)
    if baselines:
        # Last, and each in a process of its own: multithreaded torch in this process slowed every
        # pipeline run that came after it by up to ~20% (measured 2026-11-23).
        for threads in (1, 2):
            t = one_process_in_child(model_dir, data, min(steps, 4), threads, work)
            result["baselines"][f"one-process-{threads}t"] = t
            log(f"one process, {threads} thread(s), m={NUM_MICRO}: {t:.3f} s/step")
        one = result["baselines"]["one-process-1t"]
        for row in result["rows"]:
            m, stages = row["m"], row["stages"]
            row["balanced_bound_s"] = one / NUM_MICRO * m / stages * (m + stages - 1) / m
    return result


# ---------------------------------------------------------------- report


def print_report(result: dict[str, Any], out: Any = print) -> None:
    """The W1 table, hetero's per-stage ops, then ratios last."""
    base = result["baselines"]
    if base:
        out(f"\none process (stock peft), m={NUM_MICRO}: " + ", ".join(
            f"{k} {v:.3f} s/step ({SEQ_LEN * MICRO_BATCH * NUM_MICRO / v:.0f} tokens/s)" for k, v in base.items()))
    out(f"\n{'S':>2}{'m':>4}{'hetero s':>10}{'peer s':>9}{'hetero tok/s':>14}{'peer tok/s':>12}"
        f"{'layer bound':>13}{'balanced':>10}  splits (hetero / peer / bound)")
    for r in result["rows"]:
        def fmt(x: float | None, w: int, p: int = 3) -> str:
            return f"{x:>{w}.{p}f}" if x else f"{'-':>{w}}"
        tok = r["tokens_per_step"]
        out(f"{r['stages']:>2}{r['m']:>4}{fmt(r['hetero_s'], 10)}{fmt(r['peer_s'], 9)}"
            f"{fmt(tok / r['hetero_s'] if r['hetero_s'] else None, 14, 0)}{fmt(tok / r['peer_s'] if r['peer_s'] else None, 12, 0)}"
            f"{fmt(r['layer_bound_s'], 13)}{fmt(r.get('balanced_bound_s'), 10)}  "
            f"{r.get('hetero_split')} / {r['peer_split']} / {r['layer_bound_split']}")
    out("\nhetero per stage, median seconds per step (F/B compute, RA/RG waiting to receive, SA/SG sending,"
        " STEP optimizer incl. clip_wait for the other stages):")
    for r in result["rows"]:
        for k, ops in enumerate(r.get("stage_ops") or []):
            shown = "  ".join(f"{op} {ops[op]:.3f}" for op in ("F", "B", "RA", "RG", "SA", "SG", "STEP", "clip_wait")
                              if op in ops)
            out(f"  S={r['stages']} m={r['m']:<3} stage {k}: {shown}")
    out("\nratios (> 1: hetero faster; rounds alternate hetero and the peer):")
    for r in result["rows"]:
        if r.get("speedup"):
            runs = ", ".join(f"{p / h:.2f}" for h, p in zip(r["hetero"], r["peer"], strict=False))
            out(f"  S={r['stages']} m={r['m']:<3} hetero vs torch.distributed.pipelining {r['speedup']:.2f}x "
                f"(per round {runs}); {r['of_layer_bound']:.0%} of the layer-granularity bound")


def main(argv: list[str] | None = None) -> int:
    """Run W1 and print the table and ratios."""
    ap = argparse.ArgumentParser(description="W1: hetero runtime vs torch.distributed.pipelining and baselines (CPU)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2, help="alternating hetero/peer pairs at m=8 (others: one)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the one-process runs")
    ap.add_argument("--keep", type=Path, help="keep the work dir here instead of a temp dir")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--no-transport", action="store_true", help="skip the 16 MiB transport vs raw TCP comparison")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the median is over steps 3..N)")
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetero-w1-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"W1: micro-batches of {MICRO_BATCH} x {SEQ_LEN} tokens, {args.steps} steps per run (median of steps "
              f"3..{args.steps}); torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
        result = run_w1(work, tuple(args.stages), tuple(args.micro_batches), args.steps, args.rounds,
                        baselines=not args.no_baselines, log=lambda s: print(s, flush=True) if s else None)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        print_report(result)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if not args.no_transport:
        # The transport under the pipeline, in the same run: 16 MiB tensors vs a raw TCP socket.
        from bench_transport import report as transport_report

        print("\ntransport (process to process over loopback):")
        transport_report()  # the defaults of bench_transport.py: 32 x 16 MiB per round, best of 6
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
