"""Workload W3 (/work/shared/BENCHMARKS.md, issue #10): the runtime over a slow link.

    python bench/bench_w3.py                      # as root; ~5 min on 2 cores
    python bench/bench_w3.py --rates 100mbit --steps 5 --skip hetero-none

Two "hosts" on this machine that talk only over a rate-limited link: network namespaces ``a``
(10.77.0.1) and ``b`` (10.77.0.2) joined by a veth pair, with ``tc tbf`` on the egress of both veth
ends (so each direction is limited on its own, like a full-duplex Ethernet link). tbf parameters:
``burst`` = 1 ms of the rate (125 kB at 1 Gbit/s, 12.5 kB at 100 Mbit/s: a NIC cannot send faster
than its line rate, so the burst is kept small; one millisecond is still enough for the kernel's
timers to reach the rate), ``latency 50ms`` (queue limit). The achieved rate is checked with a raw
TCP stream between the namespaces, both ways, before the runs. tbf counts Ethernet frames without
preamble and inter-frame gap, so the wire carries ~1.3% less payload than a real NIC of that rate.

One stage process per host, 1 thread each. Model: W1's architecture (w1_model.W1_ARCH) with
the hidden size and sequence length chosen by measuring a stage's forward time here (the sizes,
stage forward times and ratio ``one activation message at 1 Gbit/s / stage forward`` are printed).
Three runs per rate, in this order:

  torch-pipelining  torch.distributed.pipelining Schedule1F1B over gloo, rank 0 in ``a``, rank 1 in
                    ``b`` (w3_peer_rank.py: w1_peer.pipelining_worker, launched with ``ip netns exec``);
                    plaintext, like any gloo job
  hetero-curve      ``hetero compile`` (fleet: hosts a and b, one cpu device with 1 thread each, the
                    link's bandwidth in ``links:``) then ``hetero run`` in ``a`` and
                    ``hetero worker --host b`` in ``b``: the default security for a non-loopback fleet,
                    CurveZMQ (authenticated, encrypted)
  hetero-none       the same plan switched to ``security=none`` (``hetero keys --mode none``; the
                    placement and the input hash are unchanged): no authentication, plaintext like gloo
  hetero-auto       compiled with ``planner.compression=auto`` (issue 37: the planner compresses the
                    hand-offs where that is predicted faster), CurveZMQ like hetero-curve; the report
                    gives its speed-up over hetero-curve, measured and as the two plans predicted it

Reported per rate and run: median step time over steps 3..N and tokens/s; bytes each direction of
the link carried per step (veth counters over steps 3..N) and from the model geometry; how much of
each step the link was busy each way (bytes / rate / step time); for hetero, where each stage's
time went (metrics.jsonl ``stage_ops``: F/B/STEP compute, RA/RG waiting to receive, SA/SG send
calls); and a timeline from each action's start and end (hetero: a sitecustomize hook put on the
stage processes' PYTHONPATH registers an observer on the executor's profiling seam,
``Executor.action_observers``; the peer: its stage's forward/backward chunks and the schedule's
send/recv waits), which gives each stage's compute and waits per step, the link's business during
the waits, the activations' and gradients' transit time against the wire time, and stage 1's fill
wait vs its steady per-activation wait (``--no-trace`` times neither runtime). Ratios last.
Namespaces, veths and every process started in them are removed on every exit path (exception,
Ctrl-C, SIGTERM). Not root, or ``ip netns`` refused: one line, exit 0.

This file chooses the sizes, runs the rates and reports; the parts: w3_net.py (namespaces, veth, tbf,
link counters), w3_runs.py (the peer's and hetero's runs), w3_peer_rank.py (one rank of the peer),
w3_timeline.py (the action trace and what it says); W1's model and peer are w1_model.py, w1_peer.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import w1_model as w1  # noqa: E402  (W1's model and data, resized here)
from w1_peer import split_stages  # noqa: E402
from w3_net import LinkPair, parse_rate, raw_tcp_bps  # noqa: E402
from w3_runs import OPS, compile_plan, plan_with_security, run_hetero, run_peer, stage_ops  # noqa: E402

RUNS = ("torch-pipelining", "hetero-curve", "hetero-none", "hetero-auto")
# (hidden, seq): W1's own sizes first, then each one raised.
SIZE_CANDIDATES = ((256, 128), (512, 128), (256, 256))
TARGET_RATIO = 1 / 3  # one activation message at 1 Gbit/s vs a stage's forward (BENCHMARKS.md)


def message_bytes(hidden: int, seq: int) -> int:
    """One activation (or its gradient) message's tensor: [micro_batch, seq, hidden] fp32."""
    return w1.MICRO_BATCH * seq * hidden * 4


def choose_sizes(work: Path, candidates: tuple[tuple[int, int], ...], steps: int, rounds: int = 3) -> dict[str, Any]:
    """Measure each candidate's stage forward (1 thread, training mode, one micro-batch; best of
    ``rounds``, candidates interleaved so a busy moment of this shared machine hits all of them) and
    take the cheapest whose activation message at 1 Gbit/s reaches TARGET_RATIO of the slower
    stage's forward. When none does, keep the first candidate (W1's own sizes): raising buys
    nothing then, and costs run time.

    Returns the chosen candidate {hidden, seq, model_dir, data, front_fwd_s, back_fwd_s, message_mib,
    message_s_1gbit, ratio_1gbit} plus reached (bool) and candidates (all of them)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    measured: list[dict[str, Any]] = []
    try:
        for hidden, seq in candidates:
            w1.use_sizes(hidden, seq)
            model_dir, data = w1.prepare(work / f"model-{hidden}x{seq}", steps)
            front, back = split_stages(w1.peft_model(model_dir))
            ids = torch.randint(3, w1.W1_ARCH["vocab_size"], (w1.MICRO_BATCH, seq),
                                generator=torch.Generator().manual_seed(0))
            back(front(ids).detach().requires_grad_(True))  # warm-up
            measured.append({"hidden": hidden, "seq": seq, "model_dir": model_dir, "data": data,
                             "front_fwd_s": float("inf"), "back_fwd_s": float("inf"), "_run": (front, back, ids)})
        for _ in range(rounds):
            for m in measured:
                front, back, ids = m["_run"]
                t0 = time.perf_counter()
                hidden_states = front(ids)
                t1 = time.perf_counter()
                back(hidden_states.detach().requires_grad_(True))
                t2 = time.perf_counter()
                m["front_fwd_s"], m["back_fwd_s"] = min(m["front_fwd_s"], t1 - t0), min(m["back_fwd_s"], t2 - t1)
    finally:
        for m in measured:
            m.pop("_run", None)
        gc.collect()
        torch.set_num_threads(threads)
    for m in measured:
        m["message_mib"] = message_bytes(m["hidden"], m["seq"]) / 2**20
        m["message_s_1gbit"] = message_bytes(m["hidden"], m["seq"]) * 8 / 1e9
        m["ratio_1gbit"] = m["message_s_1gbit"] / max(m["front_fwd_s"], m["back_fwd_s"])
    reaching = [m for m in measured if m["ratio_1gbit"] >= TARGET_RATIO]
    chosen = min(reaching, key=lambda m: max(m["front_fwd_s"], m["back_fwd_s"])) if reaching else measured[0]
    for m in measured:
        if m is not chosen:
            shutil.rmtree(m["model_dir"].parent, ignore_errors=True)
    w1.use_sizes(chosen["hidden"], chosen["seq"])
    return {**chosen, "reached": bool(reaching), "candidates": measured}


def _compression(run: str) -> str:
    """The planner.compression a run's plan is compiled with."""
    return "auto" if run == "hetero-auto" else "none"


def _quietly(fn: Any) -> None:
    """Run ``fn`` with Ctrl-C and SIGTERM ignored (from the main thread): teardown is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        fn()
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        fn()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_w3(steps: int = 5, rates: tuple[str, ...] = ("1gbit", "100mbit"), skip: tuple[str, ...] = (),
           sizes: tuple[tuple[int, int], ...] = SIZE_CANDIDATES, work: Path | None = None, trace: bool = True,
           log: Any = print) -> list[dict[str, Any]]:
    """Run W3; one row per (rate, run). Needs root and ``ip netns``; otherwise one unavailable row.

    Rows: rate, run, available, step_s, tokens_per_s, times, link (bytes_ab/ba per step and busy_ab/ba
    fractions over steps 3..N), geometry_bytes_per_step (activations a->b = gradients b->a), stage_ops
    (hetero), timeline (with ``trace``: per stage compute / wait s per step and the link's business
    during the waits; hetero: act/grad transit), predicted_step_s (hetero), raw_tcp_bps (a->b, b->a),
    hidden, seq, ratio_1gbit, note."""
    if steps < 3:
        raise ValueError("steps must be >= 3 (the median is over steps 3..N)")
    bits = {rate: parse_rate(rate) for rate in rates}
    if os.geteuid() != 0:
        return [{"workload": "W3", "available": False, "note": "W3 skipped: needs root (ip netns, tc)"}]
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="hetero-w3-")) if work is None else work
    work.mkdir(parents=True, exist_ok=True)
    link = LinkPair()
    rows: list[dict[str, Any]] = []
    try:
        try:
            link.up()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            return [{"workload": "W3", "available": False, "note": f"W3 skipped: cannot build the namespaces: {exc}"}]
        model = choose_sizes(work, sizes, steps)
        log(f"W3: stage forward (1 thread, {w1.MICRO_BATCH} x seq, best of 3), one activation message at 1 Gbit/s:")
        for m in model["candidates"]:
            mark = "  <- chosen" if m["hidden"] == model["hidden"] and m["seq"] == model["seq"] else ""
            log(f"  hidden {m['hidden']:>4} seq {m['seq']:>4}: forward stage0 {m['front_fwd_s'] * 1e3:6.1f} ms, "
                f"stage1 {m['back_fwd_s'] * 1e3:6.1f} ms; message {m['message_mib']:.2f} MiB = "
                f"{m['message_s_1gbit'] * 1e3:5.1f} ms at 1 Gbit/s; ratio {m['ratio_1gbit']:.3f}{mark}")
        if not model["reached"]:
            fwd = max(model["front_fwd_s"], model["back_fwd_s"])
            log(f"  no candidate reaches {TARGET_RATIO:.2f} at 1 Gbit/s on this CPU: a message grows with hidden x seq, "
                f"a stage's forward with ~hidden^2 x seq, so raising hidden lowers the ratio and raising seq leaves it "
                f"about flat; kept W1's sizes. At 100 Mbit/s the ratio is {model['message_s_1gbit'] * 10 / fwd:.2f}.")
        geometry = w1.NUM_MICRO * message_bytes(model["hidden"], model["seq"])
        base = {"workload": "W3", "hidden": model["hidden"], "seq": model["seq"], "ratio_1gbit": model["ratio_1gbit"],
                "tokens_per_step": w1.TOKENS_PER_STEP, "geometry_bytes_per_step": geometry}
        timeout = 300 + 60 * steps
        for rate in rates:
            qdisc = link.set_rate(bits[rate])
            tcp = (raw_tcp_bps(link, 0), raw_tcp_bps(link, 1))
            log(f"\n{rate}: {qdisc}; raw TCP payload a->b {tcp[0] / 1e6:.1f} Mbit/s, b->a {tcp[1] / 1e6:.1f} Mbit/s")
            common = dict(base, rate=rate, rate_bps=bits[rate], qdisc=qdisc, raw_tcp_bps=tcp)
            plans: dict[str, tuple[Path | None, str, float | None]] = {}  # planner.compression -> compiled
            for run in RUNS:
                compression = _compression(run)
                if run.startswith("hetero") and run not in skip and compression not in plans:
                    plans[compression] = compile_plan(model, bits[rate], steps, work, compression)
                    log(f"  hetero compile: {plans[compression][1]}")
            for run in RUNS:
                if run in skip:
                    continue
                t0 = time.monotonic()
                tag = f"{rate}-{run}"
                try:
                    if run == "torch-pipelining":
                        result = run_peer(link, model, steps, work, timeout, tag, trace)
                    elif plans[_compression(run)][0] is None:
                        result = {"available": False, "note": plans[_compression(run)][1]}
                    else:
                        plan_dir, _, predicted = plans[_compression(run)]
                        mode = "none" if run == "hetero-none" else "curve"
                        result = run_hetero(link, plan_with_security(plan_dir, mode), steps, work, tag, timeout, trace)
                        if result["available"]:
                            result["stage_ops"] = stage_ops(result.pop("rows"))
                        result["predicted_step_s"] = predicted
                except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
                    result = {"available": False, "note": f"{type(exc).__name__}: {exc}"}  # the other runs go on
                row = dict(common, run=run, **result)
                if row["available"]:
                    row["step_s"] = w1.median_tail(row["times"])
                    row["tokens_per_s"] = w1.TOKENS_PER_STEP / row["step_s"]
                rows.append(row)
                shown = f"{row['step_s']:.3f} s/step" if row["available"] else f"UNAVAILABLE: {row['note']}"
                log(f"  {run:<17} {shown}  ({time.monotonic() - t0:.0f} s)")
        return rows
    finally:
        _quietly(link.down)
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def print_report(rows: list[dict[str, Any]]) -> None:
    """The table, where hetero's time went, then the ratios (last)."""
    if not rows or not rows[0].get("rate"):
        print(rows[0]["note"] if rows else "W3: nothing ran")
        return
    r0 = rows[0]
    print(f"\nW3: hidden {r0['hidden']}, seq {r0['seq']}, {r0['tokens_per_step']} tokens/step "
          f"(m={w1.NUM_MICRO} x {w1.MICRO_BATCH} x {r0['seq']}); one activation message "
          f"{message_bytes(r0['hidden'], r0['seq']) / 2**20:.2f} MiB; message at 1 Gbit/s / stage forward = "
          f"{r0['ratio_1gbit']:.3f}; per step each way {r0['geometry_bytes_per_step'] / 2**20:.1f} MiB of tensors")
    print(f"\n{'rate':<9}{'run':<18}{'step s':>8}{'tokens/s':>10}{'a->b MiB':>10}{'b->a MiB':>10}"
          f"{'busy a->b':>11}{'busy b->a':>11}  note")
    for r in rows:
        if not r["available"]:
            print(f"{r['rate']:<9}{r['run']:<18}{'-':>8}{'-':>10}  UNAVAILABLE: {r['note']}")
            continue
        w = r.get("link")
        link = (f"{w['bytes_ab'] / 2**20:>10.2f}{w['bytes_ba'] / 2**20:>10.2f}{w['busy_ab']:>11.1%}{w['busy_ba']:>11.1%}"
                if w else f"{'-':>10}{'-':>10}{'-':>11}{'-':>11}")
        note = f"predicted {r['predicted_step_s']:.3f} s" if r.get("predicted_step_s") else ""
        print(f"{r['rate']:<9}{r['run']:<18}{r['step_s']:>8.3f}{r['tokens_per_s']:>10.0f}{link}  {note}{r['note']}")
    print("(MiB per step and busy fractions from the veth counters over steps 3..N, Ethernet/IP/TCP headers "
          "included; busy = bytes / link rate / time)")
    ops_rows = [r for r in rows if r["available"] and r.get("stage_ops")]
    if ops_rows:
        print("\nhetero, seconds per step by op (median of steps 3..N; RA/RG wait to receive, SA/SG send calls):")
        print(f"{'rate':<9}{'run':<14}{'stage':>6}" + "".join(f"{op:>10}" for op in OPS))
        for r in ops_rows:
            for k, ops in enumerate(r["stage_ops"]):
                print(f"{r['rate']:<9}{r['run']:<14}{k:>6}" + "".join(f"{ops[op]:>10.3f}" for op in OPS))
    timed = [r for r in rows if r["available"] and r.get("timeline")]
    if timed:
        print("\ntimeline (steps 3..N, from each action's start/end): per stage, compute (F+B) and waiting for the "
              "other stage (hetero RA/RG, peer send/recv waits) in s/step, the link toward that stage busy during "
              "those waits; exposed = step - busiest stage's compute; transit = sender's send call end -> the "
              "waiting receiver has it")
        for r in timed:
            tl = r["timeline"]
            wire = message_bytes(r["hidden"], r["seq"]) * 8 / r["rate_bps"]
            parts = []
            for k, st in enumerate(tl["stages"]):
                busy = f"{st['link_busy_in_waits']:.0%}" if st["link_busy_in_waits"] is not None else "-"
                parts.append(f"s{k} compute {st['compute_s']:.2f} wait {st['wait_s']:.2f} (link {busy})")
            exposed = r["step_s"] - max(st["compute_s"] for st in tl["stages"])
            line = f"  {r['rate']:<8} {r['run']:<17} " + "; ".join(parts) + f"; exposed {exposed:.2f}"
            if tl.get("act_transit_s") is not None or tl.get("grad_transit_s") is not None:
                fmt = {k: f"{tl[k] * 1e3:.0f} ms" if tl.get(k) is not None else "-" for k in ("act_transit_s", "grad_transit_s")}
                line += (f"; transit act {fmt['act_transit_s']} (n={tl['act_transit_n']}), grad {fmt['grad_transit_s']} "
                         f"(n={tl['grad_transit_n']}), wire time of one message {wire * 1e3:.1f} ms")
            if tl.get("ra_first_s") is not None:
                line += (f"; s1 waits for act 0 {tl['ra_first_s']:.2f} s (fill), for each later act "
                         f"{tl['ra_rest_per_mb_s'] * 1e3:.0f} ms")
            print(line)
    print("\nratios (speedup = other's step time / this step time; > 1 means faster):")
    for rate in dict.fromkeys(r["rate"] for r in rows):
        by = {r["run"]: r for r in rows if r["rate"] == rate and r["available"]}
        peer = by.get("torch-pipelining")
        for run in ("hetero-curve", "hetero-none"):
            if run in by and peer:
                print(f"  {rate:<8} {run} vs torch-pipelining {peer['step_s'] / by[run]['step_s']:6.2f}x")
        if "hetero-curve" in by and "hetero-auto" in by:
            plain, squeezed = by["hetero-curve"], by["hetero-auto"]
            predicted = (plain["predicted_step_s"] / squeezed["predicted_step_s"]
                         if plain.get("predicted_step_s") and squeezed.get("predicted_step_s") else float("nan"))
            measured = plain["step_s"] / squeezed["step_s"]
            print(f"  {rate:<8} hetero-auto vs hetero-curve (compression=auto vs none) {measured:6.2f}x measured, "
                  f"{predicted:.2f}x predicted ({measured / predicted - 1:+.0%})")
        if "hetero-curve" in by and "hetero-none" in by:
            print(f"  {rate:<8} hetero-curve vs hetero-none      {by['hetero-none']['step_s'] / by['hetero-curve']['step_s']:6.2f}x")
        exposed = {run: r["step_s"] - max(st["compute_s"] for st in r["timeline"]["stages"])
                   for run, r in by.items() if r.get("timeline")}
        if exposed:
            # Less sensitive to a neighbour slowing the CPU than step time: compute is taken out.
            print(f"  {rate:<8} exposed (step - busiest stage's compute): "
                  + ", ".join(f"{run} {t:.2f} s" for run, t in exposed.items()))


def main(argv: list[str] | None = None) -> int:
    """Run W3 and print the table and ratios."""
    ap = argparse.ArgumentParser(description="W3: hetero runtime vs torch pipelining over a rate-limited link")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"], help="tbf rates, tc spelling")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(RUNS))
    ap.add_argument("--sizes", nargs="+", default=[f"{h}x{s}" for h, s in SIZE_CANDIDATES],
                    help="hidden x seq candidates (default: W1's, then each raised)")
    ap.add_argument("--keep", type=Path, help="keep the work dir (plans, logs, run dirs) here")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--no-trace", action="store_true", help="do not time each action (the timeline section)")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the median is over steps 3..N)")
    sizes = tuple(tuple(int(x) for x in s.lower().split("x")) for s in args.sizes)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        rows = run_w3(args.steps, tuple(args.rates), tuple(args.skip), sizes, args.keep,  # type: ignore[arg-type]
                      trace=not args.no_trace)
    except KeyboardInterrupt:
        print("W3 interrupted: its namespaces and their processes are removed", file=sys.stderr)
        return 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    print_report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
