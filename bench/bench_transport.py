"""Throughput of hetero's Transport vs a raw TCP socket, one process to another over loopback.

    python bench/bench_transport.py [--mib 16] [--messages 32] [--repeats 3]

Both paths move the same float32 tensors: the raw path with ``sendall`` / ``recv_into`` a
preallocated buffer (the floor any framing can reach), the Transport path as ``act`` messages
(msgpack header + zero-copy tensor frame). Prints MB/s for each and the ratio (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time

import torch

from hetero.runtime.wire.transport import Transport

PLAN = "bench"
RAW_SOCKET_BUFFER = 4194304  # 0: kernel autotuning (measured fastest on Linux loopback); else bytes


def _tune(sock: socket.socket) -> None:
    """Give the raw baseline its best shot: no Nagle, large kernel buffers when asked."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if RAW_SOCKET_BUFFER:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RAW_SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RAW_SOCKET_BUFFER)


def _raw_receiver(port_queue: mp.Queue, nbytes: int, messages: int, rounds: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_queue.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    _tune(conn)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(rounds):
        for _ in range(messages):
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
        conn.sendall(b"k")  # one ack per round: the sender's clock stops when all bytes landed
    conn.close()
    srv.close()


def _raw_sender(nbytes: int, messages: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_raw_receiver, args=(q, nbytes, messages, rounds))
    proc.start()
    port = q.get(timeout=60)
    sock = socket.create_connection(("127.0.0.1", port))
    _tune(sock)
    payload = memoryview(torch.randn(nbytes // 4).numpy()).cast("B")
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(messages):
            sock.sendall(payload)
        assert sock.recv(1) == b"k"
        times.append(time.perf_counter() - start)
    sock.close()
    proc.join(timeout=60)
    return times


def _transport_receiver(port_queue: mp.Queue, sender_endpoint: str, messages: int, rounds: int) -> None:
    with Transport("stage1", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=120) as tr:
        port_queue.put(tr.endpoint)
        tr.connect("stage0", sender_endpoint)
        for r in range(rounds):
            for mb in range(messages):
                msg = tr.recv("act", step=r, mb=mb)
                del msg  # release the receive frame as the runtime would after its forward
            tr.send("stage0", "stepdone", step=r)


def _transport_sender(nbytes: int, messages: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    times = []
    with Transport("stage0", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=120) as tr:
        proc = ctx.Process(target=_transport_receiver, args=(q, tr.endpoint, messages, rounds))
        proc.start()
        tr.connect("stage1", q.get(timeout=60))
        tensor = torch.randn(nbytes // 4)
        # Warm the connection (ZeroMQ connects lazily) so the first round is not charged for it.
        tr.send("stage1", "heartbeat")
        for r in range(rounds):
            start = time.perf_counter()
            for mb in range(messages):
                tr.send("stage1", "act", step=r, mb=mb, tensors={"x": tensor})
            tr.recv("stepdone", step=r)
            times.append(time.perf_counter() - start)
        proc.join(timeout=60)
    return times


def main() -> None:
    """Run both paths and print MB/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="tensor size in MiB")
    parser.add_argument("--messages", type=int, default=32, help="tensors per timed round")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best is reported)")
    args = parser.parse_args()
    report(args.mib, args.messages, args.repeats)


def measure(mib: int = 16, messages: int = 32, repeats: int = 3) -> tuple[float, float]:
    """Best MB/s of a raw TCP socket and of the Transport, process to process over loopback."""
    return measure_bytes(mib << 20, messages, repeats)


def measure_bytes(nbytes: int, messages: int, repeats: int = 3) -> tuple[float, float]:
    """Best MB/s of a raw TCP socket and of the Transport for messages of ``nbytes`` (a multiple of 4)."""
    total = nbytes * messages
    raw_best, tr_best = float("inf"), float("inf")
    for _ in range(2):
        raw_best = min(raw_best, *_raw_sender(nbytes, messages, repeats))
        tr_best = min(tr_best, *_transport_sender(nbytes, messages, repeats))
    return total / raw_best / 1e6, total / tr_best / 1e6


SWEEP_BYTES = (64 << 10, 1 << 20, 16 << 20, 64 << 20)


def sweep(sizes: tuple[int, ...] = SWEEP_BYTES, round_bytes: int = 64 << 20, repeats: int = 2) -> list[dict]:
    """Transport vs raw TCP from 64 KiB to 64 MiB messages; each round moves ~``round_bytes``
    (at least 4 and at most 1024 messages), best of 2 x ``repeats`` rounds. Rows of dicts."""
    rows = []
    for nbytes in sizes:
        messages = max(4, min(1024, round_bytes // nbytes))
        raw, tr = measure_bytes(nbytes, messages, repeats)
        rows.append({"bytes": nbytes, "messages": messages, "raw_mb_s": raw, "transport_mb_s": tr, "ratio": tr / raw})
    return rows


def report(mib: int = 16, messages: int = 32, repeats: int = 3) -> None:
    """Measure both paths and print MB/s and the ratio (bench_runtime.py calls this too)."""
    raw_mbs, tr_mbs = measure_bytes(mib << 20, messages, repeats)
    print(f"message size          : {mib} MiB float32 x {messages} per round, best of {2 * repeats}")
    print(f"raw TCP socket        : {raw_mbs:9.1f} MB/s")
    print(f"hetero Transport      : {tr_mbs:9.1f} MB/s")
    print(f"ratio Transport / raw : {tr_mbs / raw_mbs:9.3f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
