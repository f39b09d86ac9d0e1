"""W3's link: two network namespaces joined by a veth pair, ``tc tbf`` on the egress of both ends (each
direction limited on its own, like a full-duplex Ethernet link), a raw TCP stream to check the rate
reached, and a sampler of the veth counters that says how many bytes crossed between two moments.

tbf: ``burst`` = 1 ms of the rate (a NIC cannot send faster than its line rate, so the burst is kept
small; one millisecond is still enough for the kernel's timers to reach the rate), ``latency 50ms``.
"""

from __future__ import annotations

import bisect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

IPS = ("10.77.0.1", "10.77.0.2")
BURST_S = 1e-3  # tbf burst: this much time at the link rate
TBF_LATENCY = "50ms"


def parse_rate(rate: str) -> float:
    """``1gbit`` / ``100mbit`` / ``500kbit`` (tc's spelling) -> bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: write e.g. 1gbit, 100mbit, 500kbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def netns_refused() -> str | None:
    """Why this machine cannot make network namespaces (not root, no ``ip netns``), or None when it can."""
    probe = f"w3-probe-{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return (made.stderr or made.stdout).strip() or "ip netns add failed"
    _ip("netns", "del", probe)
    return None


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
