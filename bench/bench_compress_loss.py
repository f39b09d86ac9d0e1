"""What compressed hand-offs do to the loss (issue 37): W1 trained with planner.compression=none, int8 and int4.

    python bench/bench_compress_loss.py                 # 200 steps per scheme, ~15-20 min on 2 cores
    python bench/bench_compress_loss.py --steps 40 --schemes none int8

W1's model and run (2 CPU stages x 1 thread, 1F1B, 8 micro-batches of 4 x 128 tokens, fp32, LoRA r=8 on every
projection, lr 1e-3), compiled once per scheme with planner.interleave=off, so only the hand-offs differ: with int8
or int4 every activation going forward and every gradient coming back crosses the link compressed
(runtime/wire/compress.py) and is decoded on the receiver.

The data must be learnable, or every run would sit at the entropy of random tokens and agree trivially: rows of a
Markov chain over 64 of the vocabulary's tokens, each followed by its own successor 90 % of the time and by any of the
64 otherwise (entropy ~0.73 nats a token): the LoRA'd layers learn it slowly (the loss falls from ~7.7 past 6.7 in
the first 35 steps, measured in one process), so the compressed runs are compared while the model is learning.
Reported: the loss every 20 steps side by side, each scheme's mean over its last 20 steps and its difference from
the uncompressed run's (the acceptance: int8 within 1 %; int4's figure whatever it is), and the largest per-step
difference. Losses do not depend on timing, so the machine may be busy meanwhile.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import w1_model as w1  # noqa: E402
from w1_hetero import compile_hetero, run_plan  # noqa: E402

from hetero.runtime.run.metrics_file import NAME, read_metrics  # noqa: E402

ALPHABET = 64  # tokens the chain uses (ids 3..66)
FOLLOW = 0.9  # how often a token is followed by its own successor
TAIL = 20  # the last steps whose mean loss is compared
INT8_TOLERANCE = 0.01  # the acceptance: int8's tail mean within 1 % of the uncompressed run's


def chain_rows(path: Path, rows: int, seq: int, seed: int = 0) -> None:
    """Write ``rows`` tokens-format rows of ``seq`` tokens of the chain (the module docstring), fixed by ``seed``."""
    rng = random.Random(seed)
    alphabet = list(range(3, 3 + ALPHABET))
    successor = dict(zip(alphabet, rng.sample(alphabet, len(alphabet)), strict=True))
    with path.open("w") as f:
        for _ in range(rows):
            token = rng.choice(alphabet)
            row = [token]
            for _ in range(seq - 1):
                token = successor[token] if rng.random() < FOLLOW else rng.choice(alphabet)
                row.append(token)
            f.write(json.dumps({"input_ids": row}) + "\n")


def losses(work: Path, model_dir: Path, data: Path, steps: int, scheme: str) -> list[float]:
    """Per-step losses of W1 trained with planner.compression=``scheme`` (metrics.jsonl)."""
    plan, note = compile_hetero(model_dir, data, steps, work, (f"planner.compression={scheme}", "planner.interleave=off"),
                                name=f"plan-{scheme}")
    if plan is None:
        raise RuntimeError(note)
    compressed = [s.get("compress_out", "none") for s in json.loads(plan.read_text())["stages"]][:-1]
    if compressed != [scheme] * len(compressed):
        raise RuntimeError(f"planner.compression={scheme} planned hand-offs {compressed}")
    times, note = run_plan(plan, steps, work)
    if times is None:
        raise RuntimeError(note)
    return [s.loss for s in read_metrics(work / "run" / NAME).steps]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W1 losses with compressed hand-offs vs none")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--schemes", nargs="+", default=["none", "int8", "int4"], choices=["none", "int8", "int4"])
    ap.add_argument("--json", type=Path, help="also write every run's per-step losses here")
    args = ap.parse_args(argv)
    if "none" not in args.schemes:
        ap.error("--schemes must include none (the reference)")
    work = Path(tempfile.mkdtemp(prefix="hetero-compress-loss-"))
    try:
        model_dir, data = w1.prepare(work, args.steps)
        chain_rows(data, args.steps * w1.MICRO_BATCH * w1.NUM_MICRO, w1.SEQ_LEN)
        runs: dict[str, list[float]] = {}
        for scheme in args.schemes:
            runs[scheme] = losses(work, model_dir, data, args.steps, scheme)
            print(f"{scheme}: {len(runs[scheme])} steps, loss {runs[scheme][0]:.4f} -> {runs[scheme][-1]:.4f}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(runs))
        report(runs, args.steps)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(runs: dict[str, list[float]], steps: int) -> None:
    """The loss curves side by side, then the tail means against the uncompressed run's."""
    names = list(runs)
    print(f"\n{'step':>6}" + "".join(f"{n:>10}" for n in names))
    for step in sorted({1, *range(20, steps + 1, 20), steps}):
        print(f"{step:>6}" + "".join(f"{runs[n][step - 1]:>10.4f}" for n in names))
    tail = min(TAIL, steps)
    ref = statistics.mean(runs["none"][-tail:])
    print(f"\nmean loss of the last {tail} steps (difference from none; largest per-step difference over the run):")
    for n in names:
        mean = statistics.mean(runs[n][-tail:])
        worst = max(abs(a - b) / b for a, b in zip(runs[n], runs["none"], strict=True))
        verdict = ""
        if n == "int8":
            verdict = f"  {'OK' if abs(mean / ref - 1) <= INT8_TOLERANCE else 'MISSED'} (target within {INT8_TOLERANCE:.0%})"
        print(f"  {n:<5} {mean:.4f} ({mean / ref - 1:+.2%}; per step at most {worst:.2%}){verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
