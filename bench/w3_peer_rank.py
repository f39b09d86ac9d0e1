"""One rank of W3's peer, started by w3_runs.run_peer inside its namespace:

    python bench/w3_peer_rank.py --peer-rank 0 --master 10.77.0.1 --port 29400 --model-dir M --data D \\
        --steps 5 --out times.json --marks marks.txt --hidden 256 --seq 128 --trace DIR

w1_peer.pipelining_worker over the link, with three additions, none of which changes what runs: the
rendezvous address is the link's; Schedule1F1B appends a line to --marks after each step (rank 0: the
sampler's step boundaries); with --trace, PipelineStage's forward/backward chunks, the last stage's
loss and the schedule's waits on send/recv work are timed into DIR/stage<rank>.jsonl as
[op, step, mb, t0, t1] (wall clock), as the hetero trace is (w3_timeline.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import w1_model as w1
from w1_peer import pipelining_worker


def run_rank(args: argparse.Namespace) -> int:
    """Run this rank of the peer with the marks and, with --trace, the timing."""
    w1.use_sizes(args.hidden, args.seq)
    import torch.distributed.pipelining as pipelining
    import torch.distributed.pipelining.schedules as schedules

    trace = open(Path(args.trace) / f"stage{args.peer_rank}.jsonl", "a", buffering=1) if args.trace else None
    state = {"step": 0}

    def record(op: str, mb: int, t0: float) -> None:
        if trace is not None:
            trace.write(json.dumps([op, state["step"], mb, t0, time.time()]) + "\n")

    real_wait = schedules._wait_batch_p2p

    def timed_wait(*a: Any, **kw: Any) -> Any:
        t0 = time.time()
        result = real_wait(*a, **kw)
        record("W", -1, t0)
        return result

    class MarkedSchedule(pipelining.Schedule1F1B):  # type: ignore[misc]
        def step(self, *a: Any, **kw: Any) -> Any:
            result = super().step(*a, **kw)
            if args.marks:
                with open(args.marks, "a") as f:
                    f.write(f"{time.time()}\n")
            state["step"] += 1
            return result

        def _maybe_compute_loss(self, stage: Any, output: Any, target_mbs: Any, mb: int, *a: Any) -> Any:
            t0 = time.time()
            result = super()._maybe_compute_loss(stage, output, target_mbs, mb, *a)
            if stage.is_last:
                record("L", mb, t0)
            return result

    class TimedStage(pipelining.PipelineStage):  # type: ignore[misc]
        def forward_one_chunk(self, *a: Any, **kw: Any) -> Any:
            t0 = time.time()
            result = super().forward_one_chunk(*a, **kw)
            record("F", a[0] if a else kw.get("fwd_chunk_id", -1), t0)
            return result

        def backward_one_chunk(self, *a: Any, **kw: Any) -> Any:
            t0 = time.time()
            result = super().backward_one_chunk(*a, **kw)
            record("B", a[0] if a else kw.get("bwd_chunk_id", -1), t0)
            return result

    # The schedule's waits on send/recv work are a module function of torch's: no seam but this one.
    schedules._wait_batch_p2p = timed_wait
    pipelining_worker(args.peer_rank, args.port, args.model_dir, args.data, args.steps, args.out, addr=args.master,
                      stage_cls=TimedStage, schedule_cls=MarkedSchedule)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse one rank's settings (as w3_runs.run_peer writes them) and run it."""
    ap = argparse.ArgumentParser(description="one rank of W3's peer (started by bench_w3.py in a namespace)")
    ap.add_argument("--peer-rank", type=int, required=True)
    ap.add_argument("--master", required=True, help="rank 0's address on the link (the rendezvous)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True, help="rank 0 writes the per-step seconds here")
    ap.add_argument("--marks", default="", help="append one line per step here (empty: none)")
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--trace", default="", help="time chunks and waits into DIR/stage<rank>.jsonl (empty: no)")
    return run_rank(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
