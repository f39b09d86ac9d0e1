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

One stage process per host, 1 thread each. Model: W1's architecture (bench_runtime.W1_ARCH) with
the hidden size and sequence length chosen by measuring a stage's forward time here (the sizes,
stage forward times and ratio ``one activation message at 1 Gbit/s / stage forward`` are printed).
Three runs per rate, in this order:

  torch-pipelining  torch.distributed.pipelining Schedule1F1B over gloo, rank 0 in ``a``, rank 1 in
                    ``b`` (bench_runtime._pipelining_worker, launched with ``ip netns exec``);
                    plaintext, like any gloo job
  hetero-curve      ``hetero compile`` (fleet: hosts a and b, one cpu device with 1 thread each, the
                    link's bandwidth in ``links:``) then ``hetero run`` in ``a`` and
                    ``hetero worker --host b`` in ``b``: the default security for a non-loopback fleet,
                    CurveZMQ (authenticated, encrypted)
  hetero-none       the same plan switched to ``security=none`` (``hetero keys --mode none``; the
                    placement and the input hash are unchanged): no authentication, plaintext like gloo

Reported per rate and run: median step time over steps 3..N and tokens/s; bytes each direction of
the link carried per step (veth counters over steps 3..N) and from the model geometry; how much of
each step the link was busy each way (bytes / rate / step time); for hetero, where each stage's
time went (metrics.jsonl ``stage_ops``: F/B/STEP compute, RA/RG waiting to receive, SA/SG send
calls); and a timeline from each action's start and end (hetero: a sitecustomize hook put on the
stage processes' PYTHONPATH wraps the Executor's handlers, runtime/ is untouched; the peer: its
stage's forward/backward chunks and the schedule's send/recv waits), which gives each stage's compute
and waits per step, the link's business during the waits, the activations' and gradients' transit
time against the wire time, and stage 1's fill wait vs its steady per-activation wait
(``--no-trace`` leaves both runtimes unwrapped). Ratios last. Namespaces, veths and every process started in them are removed on every exit
path (exception, Ctrl-C, SIGTERM). Not root, or ``ip netns`` refused: one line, exit 0.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_runtime as br  # noqa: E402  (W1's model, data, helpers and the peer's worker)

IPS = ("10.77.0.1", "10.77.0.2")
HOSTS = ("a", "b")  # plan host names: stage 0 (and the coordinator) on a, stage 1 on b
BASE_PORT = 29500  # fresh namespaces: nothing else can hold it
PEER_PORT = 29400  # torch.distributed's rendezvous (TCPStore) on a
RUNS = ("torch-pipelining", "hetero-curve", "hetero-none")
BURST_S = 1e-3  # tbf burst: this much time at the link rate
TBF_LATENCY = "50ms"
# (hidden, seq): W1's own sizes first, then each one raised.
SIZE_CANDIDATES = ((256, 128), (512, 128), (256, 256))
TARGET_RATIO = 1 / 3  # one activation message at 1 Gbit/s vs a stage's forward (BENCHMARKS.md)
HETERO = [sys.executable, "-m", "hetero.cli"]
_W1_ARCH = dict(br.W1_ARCH)
_OPS = ("data_wait", "RA", "F", "SA", "RG", "B", "SG", "STEP", "clip_wait")


# ---------------------------------------------------------------- sizes


def use_sizes(hidden: int, seq: int) -> None:
    """Point bench_runtime's W1 globals at W1's architecture with this hidden size and sequence length.

    Heads stay 8 (4 KV heads), so head_dim = hidden / 8 as in W1 (256 / 8 = 32); the MLP keeps W1's
    intermediate / hidden ratio (688 / 256). bench_runtime's helpers read these globals when called."""
    heads = _W1_ARCH["num_attention_heads"]
    br.W1_ARCH = dict(_W1_ARCH, hidden_size=hidden, head_dim=hidden // heads,
                      intermediate_size=round(_W1_ARCH["intermediate_size"] * hidden / _W1_ARCH["hidden_size"]),
                      max_position_embeddings=max(_W1_ARCH["max_position_embeddings"], seq))
    br.SEQ_LEN = seq
    br.TOKENS_PER_STEP = seq * br.MICRO_BATCH * br.NUM_MICRO


def message_bytes(hidden: int, seq: int) -> int:
    """One activation (or its gradient) message's tensor: [micro_batch, seq, hidden] fp32."""
    return br.MICRO_BATCH * seq * hidden * 4


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
            use_sizes(hidden, seq)
            model_dir, data = br.prepare(work / f"model-{hidden}x{seq}", steps)
            front, back = br.split_stages(br.peft_model(model_dir))
            ids = torch.randint(3, br.W1_ARCH["vocab_size"], (br.MICRO_BATCH, seq),
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
    use_sizes(chosen["hidden"], chosen["seq"])
    return {**chosen, "reached": bool(reaching), "candidates": measured}


# ---------------------------------------------------------------- the link


def parse_rate(rate: str) -> float:
    """``1gbit`` / ``100mbit`` / ``500kbit`` (tc's spelling) -> bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: write e.g. 1gbit, 100mbit, 500kbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


class LinkPair:
    """Two network namespaces joined by a veth pair, each end rate-limited on egress with tc tbf.

    Names carry this process's id, so two benchmark runs on one machine do not collide. ``down()``
    ends every process still inside either namespace (only this object starts processes there) and
    deletes both namespaces, which deletes the veth pair; it is safe to call more than once and after
    a partial ``up()``."""

    def __init__(self) -> None:
        tag = str(os.getpid())
        self.ns = (f"w3-{tag}-a", f"w3-{tag}-b")
        self.veth = (f"w3v{tag}a", f"w3v{tag}b")  # interface names: at most 15 characters
        self.rate_bps: float | None = None
        self._sleepers: list[subprocess.Popen] = []  # one per namespace: whose /proc/PID/net/dev we read
        self._created: list[str] = []

    def up(self) -> None:
        """Create the namespaces and the veth pair; raises RuntimeError with ip's message on failure."""
        a, b = self.ns
        va, vb = self.veth
        for ns in self.ns:
            self._check(_ip("netns", "add", ns))
            self._created.append(ns)
        steps = [("link", "add", va, "type", "veth", "peer", "name", vb),
                 ("link", "set", va, "netns", a), ("link", "set", vb, "netns", b),
                 ("-n", a, "addr", "add", f"{IPS[0]}/24", "dev", va), ("-n", b, "addr", "add", f"{IPS[1]}/24", "dev", vb),
                 ("-n", a, "link", "set", va, "up"), ("-n", b, "link", "set", vb, "up"),
                 ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up")]
        for args in steps:
            self._check(_ip(*args))
        for side in (0, 1):
            self._sleepers.append(subprocess.Popen(self.exec(side, ["sleep", "86400"]), stdin=subprocess.DEVNULL,
                                                   start_new_session=True))
        deadline = time.monotonic() + 10  # until each sleeper has entered its namespace
        while True:
            try:
                self.tx_bytes()
                break
            except (StopIteration, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError("cannot read the veth counters from /proc/PID/net/dev") from None
                time.sleep(0.02)

    @staticmethod
    def _check(proc: subprocess.CompletedProcess[str]) -> None:
        if proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(map(str, proc.args))}`: {(proc.stderr or proc.stdout).strip()}")

    def set_rate(self, bits_per_s: float) -> str:
        """tbf on both veth ends; returns the qdisc parameters, as said."""
        burst = max(int(bits_per_s / 8 * BURST_S), 3028)  # at least two full frames
        for ns, dev in zip(self.ns, self.veth, strict=True):
            self._check(subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                                        f"{int(bits_per_s)}bit", "burst", str(burst), "latency", TBF_LATENCY],
                                       capture_output=True, text=True, timeout=30))
        self.rate_bps = bits_per_s
        return f"tbf rate {bits_per_s / 1e6:g} Mbit/s burst {burst} B latency {TBF_LATENCY}, both ends"

    def exec(self, side: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *cmd]

    def tx_bytes(self) -> tuple[int, int]:
        """Bytes sent so far by a's veth (a->b) and by b's veth (b->a), Ethernet headers included."""
        out = []
        for sleeper, dev in zip(self._sleepers, self.veth, strict=True):
            text = Path(f"/proc/{sleeper.pid}/net/dev").read_text()
            line = next(ln for ln in text.splitlines() if ln.strip().startswith(dev + ":"))
            out.append(int(line.split(":", 1)[1].split()[8]))  # rx: 8 fields, then tx bytes
        return out[0], out[1]

    def pids(self) -> list[int]:
        pids: list[int] = []
        for ns in self._created:
            proc = _ip("netns", "pids", ns)
            pids += [int(p) for p in proc.stdout.split() if p.isdigit()]
        return pids

    def down(self) -> None:
        """End every process in the namespaces (SIGTERM, then SIGKILL after 5 s) and delete them."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                time.sleep(0.1)
                pids = self.pids()
            if not pids:
                break
        for sleeper in self._sleepers:
            try:
                sleeper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._sleepers.clear()
        while self._created:
            _ip("netns", "del", self._created.pop())
        if _ip("link", "show", self.veth[0]).returncode == 0:  # only if it never moved into a namespace
            _ip("link", "del", self.veth[0])


# A raw TCP stream between the namespaces: the server reads to EOF and answers one byte.
_TCP_SERVER = ("import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
               "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); c, _ = s.accept()\n"
               "while c.recv(1 << 20): pass\n"
               "c.sendall(b'k')")
_TCP_CLIENT = ("import socket, sys, time\n"
               "for _ in range(100):\n"
               "    try: c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break\n"
               "    except OSError: time.sleep(0.05)\n"
               "buf, n, sent = bytes(1 << 20), int(sys.argv[3]), 0; t = time.perf_counter()\n"
               "while sent < n: c.sendall(buf); sent += len(buf)\n"
               "c.shutdown(socket.SHUT_WR); c.recv(1); print(sent * 8 / (time.perf_counter() - t))")


def raw_tcp_bps(link: LinkPair, src: int, seconds: float = 1.0, port: int = 5999) -> float:
    """Payload bits/s of one TCP stream from side ``src`` to the other, ~``seconds`` long."""
    assert link.rate_bps is not None
    dst = 1 - src
    server = subprocess.Popen(link.exec(dst, [sys.executable, "-c", _TCP_SERVER, IPS[dst], str(port)]),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        nbytes = max(int(link.rate_bps / 8 * seconds), 4 << 20)
        out = subprocess.run(link.exec(src, [sys.executable, "-c", _TCP_CLIENT, IPS[dst], str(port), str(nbytes)]),
                             capture_output=True, text=True, timeout=60 + 20 * seconds)
        if out.returncode != 0:
            raise RuntimeError(f"raw TCP test failed: {out.stderr.strip().splitlines()[-1:]}")
        return float(out.stdout.strip())
    finally:
        server.kill()
        server.wait()


class Sampler(threading.Thread):
    """Reads the link counters every ``period`` s, and notes when a file that gains one line per
    optimizer step (metrics.jsonl, the peer's marks) gains one.

    ``samples``: (wall time, a->b bytes, b->a bytes), every period; ``marks[k]``: the first sample
    taken after line k appeared."""

    def __init__(self, link: LinkPair, path: Path, period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.link, self.path, self.period = link, path, period
        self.samples: list[tuple[float, int, int]] = []
        self.marks: dict[int, tuple[float, int, int]] = {}
        self._done = threading.Event()

    def run(self) -> None:
        seen = 0
        while not self._done.wait(self.period):
            sample = (time.time(), *self.link.tx_bytes())
            self.samples.append(sample)
            try:
                lines = self.path.read_bytes().count(b"\n")
            except OSError:
                continue
            for k in range(seen + 1, lines + 1):
                self.marks[k] = sample
            seen = max(seen, lines)

    def bytes_between(self, side: int, t0: float, t1: float) -> float:
        """Bytes sent by side 0 (a->b) or 1 (b->a) between two wall times (counters interpolated)."""
        times = [s[0] for s in self.samples]

        def at(t: float) -> float:
            i = bisect.bisect_left(times, t)
            if i <= 0:
                return float(self.samples[0][1 + side])
            if i >= len(times):
                return float(self.samples[-1][1 + side])
            (ta, *va), (tb, *vb) = self.samples[i - 1], self.samples[i]
            return va[side] + (vb[side] - va[side]) * (t - ta) / (tb - ta)

        return at(t1) - at(t0) if self.samples else 0.0

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def window(self, steps: int) -> dict[str, float] | None:
        """Bytes per step each way and link busy fractions over steps 3..N (from the marks of lines 2 and N)."""
        if 2 not in self.marks or steps not in self.marks or steps <= 2 or self.link.rate_bps is None:
            return None
        (t0, a0, b0), (t1, a1, b1) = self.marks[2], self.marks[steps]
        if t1 <= t0:
            return None
        n = steps - 2
        return {"bytes_ab": (a1 - a0) / n, "bytes_ba": (b1 - b0) / n,
                "busy_ab": (a1 - a0) * 8 / self.link.rate_bps / (t1 - t0),
                "busy_ba": (b1 - b0) * 8 / self.link.rate_bps / (t1 - t0), "window_s": t1 - t0}


# ---------------------------------------------------------------- the runs


def _finish(procs: dict[str, subprocess.Popen], main: str, timeout: float) -> tuple[int | None, str]:
    """Wait for ``procs[main]`` then the others (60 s more); (its return code, a note on any failure)."""
    note = ""
    deadline = time.monotonic() + timeout
    try:
        code = procs[main].wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None, f"{main} did not finish within {timeout:.0f} s"
    for name, proc in procs.items():
        try:
            other = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            note = f"{name} still running 60 s after {main} exited"
            continue
        if other != 0 and not note:
            note = f"{name} exited with {other}"
    return code, note


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.is_file() else []
    return lines[-1] if lines else "(no output)"


def run_peer(link: LinkPair, model: dict[str, Any], steps: int, work: Path, timeout: float, tag: str,
             trace: bool = True) -> dict[str, Any]:
    """torch.distributed.pipelining, rank 0 in a and rank 1 in b; per-step times, link window, timeline."""
    out, marks, trace_dir = work / f"{tag}-times.json", work / f"{tag}-marks.txt", work / f"trace-{tag}"
    for f in (out, marks):
        f.unlink(missing_ok=True)
    shutil.rmtree(trace_dir, ignore_errors=True)
    trace_dir.mkdir(parents=True)
    procs: dict[str, subprocess.Popen] = {}
    sampler = Sampler(link, marks)
    sampler.start()
    try:
        for rank in (1, 0):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--peer-rank", str(rank), "--master", IPS[0],
                   "--port", str(PEER_PORT), "--model-dir", str(model["model_dir"]), "--data", str(model["data"]),
                   "--steps", str(steps), "--out", str(out), "--marks", str(marks) if rank == 0 else "",
                   "--hidden", str(model["hidden"]), "--seq", str(model["seq"]), "--trace", str(trace_dir) if trace else ""]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.veth[rank], "PYTHONUNBUFFERED": "1"}
            with open(work / f"{tag}-rank{rank}.log", "w") as log:
                procs[f"rank{rank}"] = subprocess.Popen(link.exec(rank, cmd), stdin=subprocess.DEVNULL, stdout=log,
                                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code, note = _finish(procs, "rank0", timeout)
    finally:
        sampler.stop()
        for proc in procs.values():  # (a timeout or Ctrl-C) LinkPair.down() ends the rest
            if proc.poll() is None:
                proc.kill()
    if code != 0 or not out.is_file():
        return {"available": False, "note": note or f"rank 0: {_last_line(work / f'{tag}-rank0.log')}"}
    return {"available": True, "times": json.loads(out.read_text()), "link": sampler.window(steps), "note": note,
            "timeline": timeline(trace_dir, sampler, steps) if trace else None}


def _peer_rank(args: argparse.Namespace) -> int:
    """One rank of the peer (run inside its namespace): bench_runtime._pipelining_worker over the link.

    Three substitutions, none of which changes what runs: the rendezvous address is the link's (the
    worker sets 127.0.0.1); Schedule1F1B appends a line to --marks after each step (rank 0: the
    sampler's step boundaries); with --trace, PipelineStage's forward/backward chunks, the last
    stage's loss and the schedule's waits on send/recv work are timed, as the hetero trace is."""
    use_sizes(args.hidden, args.seq)
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    import torch.distributed.pipelining.schedules as schedules

    trace = open(Path(args.trace) / f"stage{args.peer_rank}.jsonl", "a", buffering=1) if args.trace else None
    state = {"step": 0}

    def record(op: str, mb: int, t0: float) -> None:
        if trace is not None:
            trace.write(json.dumps([op, state["step"], mb, t0, time.time()]) + "\n")

    real_init, real_wait = dist.init_process_group, schedules._wait_batch_p2p

    def init_over_link(*a: Any, **kw: Any) -> Any:
        os.environ["MASTER_ADDR"] = args.master  # _pipelining_worker points it at 127.0.0.1 (one host)
        return real_init(*a, **kw)

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

    dist.init_process_group = init_over_link  # type: ignore[assignment]
    schedules._wait_batch_p2p = timed_wait
    pipelining.Schedule1F1B = MarkedSchedule  # type: ignore[misc]
    pipelining.PipelineStage = TimedStage  # type: ignore[misc]
    br._pipelining_worker(args.peer_rank, args.port, args.model_dir, args.data, args.steps, args.out)
    return 0


def compile_plan(model: dict[str, Any], rate_bps: float, steps: int, work: Path) -> tuple[Path | None, str, float | None]:
    """`hetero compile` for the two-host fleet with this link; returns (plan dir, note, predicted step s)."""
    conf = work / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    devices = "      - {type: cpu, count: 1, threads: 1}\n"
    hosts = "".join(f"  - name: {h}\n    address: {ip}\n    port: {BASE_PORT}\n    devices:\n{devices}"
                    for h, ip in zip(HOSTS, IPS, strict=True))
    (conf / "hardware" / "w3.yaml").write_text(
        f"name: w3\nhosts:\n{hosts}links:\n  - {{a: {HOSTS[0]}, b: {HOSTS[1]}, bandwidth_gbps: {rate_bps / 1e9:g}, "
        "latency_us: 50}\n")
    out = work / f"plan-{rate_bps / 1e6:g}mbit"
    cmd = HETERO + [
        "compile", "-cd", str(conf), "model=hf", f"model.pretrained={model['model_dir']}", f"model.seq_len={model['seq']}",
        "model.dtype=float32", "lora.r=8", "lora.alpha=16", "hardware=w3", f"train.micro_batch_size={br.MICRO_BATCH}",
        f"train.num_micro_batches={br.NUM_MICRO}", f"train.steps={steps}", f"train.lr={br.LR}", "train.schedule=1f1b",
        f"data.path={model['data']}", "data.format=tokens", "planner.num_stages=2", f"output={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=600)
    if proc.returncode != 0:
        return None, f"hetero compile failed: {_last_line_of(proc.stderr or proc.stdout)}", None
    plan = json.loads((out / "plan.json").read_text())
    hosts_of = [s["host"] for s in plan["stages"]]
    if hosts_of != list(HOSTS):
        return None, f"plan puts stages on hosts {hosts_of}, not {list(HOSTS)}", None
    predicted = float(plan["prediction"]["step_time_s"])
    split = "/".join(str(sum(n.startswith("layers.") for n in s["node_names"])) for s in plan["stages"])
    return out, (f"stage 0 on {hosts_of[0]}, stage 1 on {hosts_of[1]}, layers {split}; predicted {predicted:.3f} "
                 f"s/step; security {plan['security']['mode']}"), predicted


def _last_line_of(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def plan_with_security(plan_dir: Path, mode: str) -> Path:
    """A copy of the plan switched to ``mode`` (curve keeps the compiled one)."""
    if mode == "curve":
        return plan_dir
    copy = plan_dir.with_name(f"{plan_dir.name}-{mode}")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(plan_dir, copy)
    proc = subprocess.run(HETERO + ["keys", str(copy / "plan.json"), "--mode", mode], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"hetero keys --mode {mode}: {_last_line_of(proc.stderr or proc.stdout)}")
    return copy


def run_hetero(link: LinkPair, plan_dir: Path, steps: int, work: Path, tag: str, timeout: float,
               trace: bool = True) -> dict[str, Any]:
    """`hetero worker --host b` in b and `hetero run` in a; metrics.jsonl rows, link window, timeline."""
    run_dir, worker_dir, trace_dir = work / f"run-{tag}", work / f"worker-{tag}", work / f"trace-{tag}"
    for d in (run_dir, worker_dir, trace_dir):
        shutil.rmtree(d, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if trace:
        hook = work / "trace-hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(_TRACE_HOOK)
        trace_dir.mkdir(parents=True)
        env.update(W3_TRACE=str(trace_dir), PYTHONPATH=os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")])))
    plan = str(plan_dir / "plan.json")
    sampler = Sampler(link, run_dir / "metrics.jsonl")
    procs: dict[str, subprocess.Popen] = {}
    sampler.start()
    try:
        commands = {"worker": (1, ["worker", plan, "--host", HOSTS[1], "--run-dir", str(worker_dir)]),
                    "run": (0, ["run", plan, "--run-dir", str(run_dir), "--no-progress"])}
        for name, (side, args) in commands.items():
            with open(work / f"{tag}-{name}.log", "w") as log:
                procs[name] = subprocess.Popen(link.exec(side, HETERO + args), stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, cwd=work, start_new_session=True, env=env)
        code, note = _finish(procs, "run", timeout)
    finally:
        sampler.stop()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.is_file() else []
    if code != 0 or len(rows) < steps:
        why = note or f"hetero run: {_last_line(work / f'{tag}-run.log')}"
        return {"available": False, "note": f"{why} ({len(rows)} of {steps} steps in metrics.jsonl)"}
    return {"available": True, "times": [float(r["step_time_s"]) for r in rows], "rows": rows,
            "link": sampler.window(steps), "note": note, "timeline": timeline(trace_dir, sampler, steps) if trace else None}


# Put first on a hetero process's PYTHONPATH (with W3_TRACE=DIR): when hetero.runtime.stage.executor is
# imported, wraps each Executor's action handlers so every action appends [op, step, mb, t0, t1]
# (wall clock) to DIR/stage<k>.jsonl. Nothing else changes; without W3_TRACE it does nothing.
_TRACE_HOOK = '''"""bench_w3 --trace: time each runtime action of a hetero stage (W3_TRACE=DIR)."""
import importlib.abc
import importlib.util
import json
import os
import sys
import time

TARGET = "hetero.runtime.stage.executor"


def _patch(module):
    cls = module.Executor
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        out = open(os.path.join(os.environ["W3_TRACE"], f"stage{self.stage.index}.jsonl"), "a", buffering=1)

        def timed(op, handler):
            def run(step, mb):
                t0 = time.time()
                handler(step, mb)
                out.write(json.dumps([op, step, mb, t0, time.time()]) + "\\n")
            return run

        self._handlers = {op: timed(op, h) for op, h in self._handlers.items()}

    cls.__init__ = __init__


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
        return spec


if os.environ.get("W3_TRACE"):
    sys.meta_path.insert(0, _Hook())
'''

_COMPUTE = ("F", "B", "L")  # forward (with the last stage's loss), backward
_WAITS = ("RA", "RG", "W")  # hetero: waiting for an activation / a gradient; the peer: waiting on send/recv work


def timeline(trace_dir: Path, sampler: Sampler, steps: int) -> dict[str, Any] | None:
    """From a run's trace (stage<k>.jsonl) and the link samples, over steps 3..N, per stage: compute
    and wait seconds per step, and how busy the link toward that stage was while it waited; for
    hetero, each activation's / gradient's transit (the sender's SA/SG end to the receiver's RA/RG
    end) when the receiver was already waiting for it."""
    traces: dict[int, list[list[Any]]] = {}
    for f in sorted(trace_dir.glob("stage*.jsonl")):
        rows = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
        if rows:
            traces[int(f.stem[len("stage"):])] = rows
    if sorted(traces) != [0, 1] or sampler.link.rate_bps is None or not sampler.samples:
        return None
    all_steps = sorted({r[1] for rows in traces.values() for r in rows})
    kept = set(all_steps[2:steps])
    n = max(1, len(kept))
    out: dict[str, Any] = {"stages": []}
    for k in (0, 1):
        rows = [r for r in traces[k] if r[1] in kept]
        waits = [r for r in rows if r[0] in _WAITS and r[4] - r[3] > 0.002]
        wait_s = sum(r[4] - r[3] for r in waits)
        toward = 0 if k == 1 else 1  # stage 1 waits for what a sends (a->b), stage 0 for what b sends
        moved = sum(sampler.bytes_between(toward, r[3], r[4]) for r in waits)
        out["stages"].append({
            "compute_s": sum(r[4] - r[3] for r in rows if r[0] in _COMPUTE) / n,
            "wait_s": sum(r[4] - r[3] for r in rows if r[0] in _WAITS) / n,
            "waits_over_2ms": len(waits) / n,
            "link_busy_in_waits": moved * 8 / sampler.link.rate_bps / wait_s if wait_s > 0 else None,
        })
    # hetero: stage 1's waits for its first activation (pipeline fill) vs the later ones (steady state)
    ra = [r for r in traces[1] if r[0] == "RA" and r[1] in kept]
    if ra:
        out["ra_first_s"] = sum(r[4] - r[3] for r in ra if r[2] == 0) / n
        out["ra_rest_per_mb_s"] = sum(r[4] - r[3] for r in ra if r[2] != 0) / max(1, sum(r[2] != 0 for r in ra))
    sent = {(r[0], r[1], r[2]): r[4] for k in (0, 1) for r in traces[k] if r[0] in ("SA", "SG")}
    for name, send_op, recv_op, receiver in (("act", "SA", "RA", 1), ("grad", "SG", "RG", 0)):
        transit = [r[4] - sent[(send_op, r[1], r[2])] for r in traces[receiver]
                   if r[0] == recv_op and r[1] in kept and r[4] - r[3] > 0.002 and (send_op, r[1], r[2]) in sent]
        out[f"{name}_transit_s"] = statistics.median(transit) if transit else None
        out[f"{name}_transit_n"] = len(transit)
    return out


def stage_ops(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage, the median over steps 3..N of each op's seconds per step (metrics.jsonl stage_ops)."""
    tail = rows[2:] if len(rows) > 2 else rows
    stages = len(tail[0]["stage_ops"])
    return [{op: statistics.median(float(r["stage_ops"][k].get(op, 0.0)) for r in tail) for op in _OPS}
            for k in range(stages)]


# ---------------------------------------------------------------- W3


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
        log(f"W3: stage forward (1 thread, {br.MICRO_BATCH} x seq, best of 3), one activation message at 1 Gbit/s:")
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
        geometry = br.NUM_MICRO * message_bytes(model["hidden"], model["seq"])
        base = {"workload": "W3", "hidden": model["hidden"], "seq": model["seq"], "ratio_1gbit": model["ratio_1gbit"],
                "tokens_per_step": br.TOKENS_PER_STEP, "geometry_bytes_per_step": geometry}
        timeout = 300 + 60 * steps
        for rate in rates:
            qdisc = link.set_rate(bits[rate])
            tcp = (raw_tcp_bps(link, 0), raw_tcp_bps(link, 1))
            log(f"\n{rate}: {qdisc}; raw TCP payload a->b {tcp[0] / 1e6:.1f} Mbit/s, b->a {tcp[1] / 1e6:.1f} Mbit/s")
            common = dict(base, rate=rate, rate_bps=bits[rate], qdisc=qdisc, raw_tcp_bps=tcp)
            plan_dir, plan_note, predicted = None, "", None
            if any(r.startswith("hetero") for r in RUNS if r not in skip):
                plan_dir, plan_note, predicted = compile_plan(model, bits[rate], steps, work)
                log(f"  hetero compile: {plan_note}")
            for run in RUNS:
                if run in skip:
                    continue
                t0 = time.monotonic()
                tag = f"{rate}-{run}"
                try:
                    if run == "torch-pipelining":
                        result = run_peer(link, model, steps, work, timeout, tag, trace)
                    elif plan_dir is None:
                        result = {"available": False, "note": plan_note}
                    else:
                        mode = run.split("-", 1)[1]
                        result = run_hetero(link, plan_with_security(plan_dir, mode), steps, work, tag, timeout, trace)
                        if result["available"]:
                            result["stage_ops"] = stage_ops(result.pop("rows"))
                        result["predicted_step_s"] = predicted
                except (RuntimeError, OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
                    result = {"available": False, "note": f"{type(exc).__name__}: {exc}"}  # the other runs go on
                row = dict(common, run=run, **result)
                if row["available"]:
                    row["step_s"] = br.median_tail(row["times"])
                    row["tokens_per_s"] = br.TOKENS_PER_STEP / row["step_s"]
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
          f"(m={br.NUM_MICRO} x {br.MICRO_BATCH} x {r0['seq']}); one activation message "
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
        print(f"{'rate':<9}{'run':<14}{'stage':>6}" + "".join(f"{op:>10}" for op in _OPS))
        for r in ops_rows:
            for k, ops in enumerate(r["stage_ops"]):
                print(f"{r['rate']:<9}{r['run']:<14}{k:>6}" + "".join(f"{ops[op]:>10.3f}" for op in _OPS))
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
        if "hetero-curve" in by and "hetero-none" in by:
            print(f"  {rate:<8} hetero-curve vs hetero-none      {by['hetero-none']['step_s'] / by['hetero-curve']['step_s']:6.2f}x")
        exposed = {run: r["step_s"] - max(st["compute_s"] for st in r["timeline"]["stages"])
                   for run, r in by.items() if r.get("timeline")}
        if exposed:
            # Less sensitive to a neighbour slowing the CPU than step time: compute is taken out.
            print(f"  {rate:<8} exposed (step - busiest stage's compute): "
                  + ", ".join(f"{run} {t:.2f} s" for run, t in exposed.items()))


def main(argv: list[str] | None = None) -> int:
    """Run W3 and print the table and ratios (or, with --peer-rank, one rank of the peer)."""
    ap = argparse.ArgumentParser(description="W3: hetero runtime vs torch pipelining over a rate-limited link")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"], help="tbf rates, tc spelling")
    ap.add_argument("--skip", nargs="*", default=[], choices=list(RUNS))
    ap.add_argument("--sizes", nargs="+", default=[f"{h}x{s}" for h, s in SIZE_CANDIDATES],
                    help="hidden x seq candidates (default: W1's, then each raised)")
    ap.add_argument("--keep", type=Path, help="keep the work dir (plans, logs, run dirs) here")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--no-trace", action="store_true", help="do not time each action (the timeline section)")
    for opt in ("--peer-rank", "--master", "--port", "--model-dir", "--data", "--out", "--marks", "--hidden", "--seq",
                "--trace"):
        ap.add_argument(opt, help=argparse.SUPPRESS)  # one rank of the peer, started inside a namespace
    args = ap.parse_args(argv)
    if args.peer_rank is not None:
        for key in ("peer_rank", "port", "hidden", "seq"):
            setattr(args, key, int(getattr(args, key)))
        return _peer_rank(args)
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
