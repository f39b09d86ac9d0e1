"""What CurveZMQ adds to one hand-off: a message's one-way time with and without the cipher (issue 37).

    python bench/bench_cipher.py [--mib 0.5 4 16] [--repeats 7]

Two processes on loopback, a ZeroMQ PAIR each (as hetero's transport, one connection per peer), ping-pong of one
message of each size: the one-way time is half the round trip. Run once as plain ZeroMQ and once with CURVE keys
(what `security=curve` sets, the default off loopback). A message is encrypted whole by the sender's I/O thread and
decrypted whole by the receiver's, so under the cipher a hand-off takes its transfer plus that work; the extra
seconds per byte, fitted over the sizes, are what planner/model/cost_model.py's CURVE_BYTES_PER_S prices on every link
that is not measured (a `hetero profile` measures links under the mode the plan uses, the cipher included).
Loopback's own transfer is the same in both runs, so the difference is the cipher's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import zmq


def _echo(endpoint: str, keys: tuple[bytes, bytes, bytes] | None, rounds: int) -> None:
    """The far side: receive each message and send it straight back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    if keys is not None:
        public, secret, server_public = keys
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
    sock.connect(endpoint)
    for _ in range(rounds):
        sock.send(sock.recv(copy=False), copy=False)
    sock.close(linger=1000)
    ctx.term()


def one_way_s(size: int, repeats: int, curve: bool) -> float:
    """Median one-way seconds of a ``size``-byte message over loopback (half a round trip), after a warm-up."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    keys = None
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        sock.curve_server, sock.curve_secretkey = True, server_secret
        keys = (client_public, client_secret, server_public)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer = mp.get_context("spawn").Process(target=_echo, args=(f"tcp://127.0.0.1:{port}", keys, repeats + 2))
    peer.start()
    payload = bytes(size)
    times = []
    try:
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            sock.send(payload, copy=False)
            sock.recv(copy=False)
            if i >= 2:  # the first two warm the connection and the allocator up
                times.append((time.perf_counter() - t0) / 2)
    finally:
        peer.join(timeout=60)
        sock.close(linger=0)
        ctx.term()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CurveZMQ's cost per hand-off on loopback")
    ap.add_argument("--mib", type=float, nargs="+", default=[0.5, 4.0, 16.0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    print(f"{'MiB':>6}{'plain ms':>11}{'curve ms':>11}{'extra ms':>11}{'cipher GB/s':>13}")
    sizes, extras = [], []
    for mib in args.mib:
        size = int(mib * 2**20)
        plain, curve = one_way_s(size, args.repeats, False), one_way_s(size, args.repeats, True)
        sizes.append(size)
        extras.append(curve - plain)
        print(f"{mib:>6g}{plain * 1e3:>11.2f}{curve * 1e3:>11.2f}{(curve - plain) * 1e3:>11.2f}"
              f"{size / max(curve - plain, 1e-12) / 1e9:>13.3f}")
    slope = sum(s * e for s, e in zip(sizes, extras, strict=True)) / sum(s * s for s in sizes)
    print(f"\nfitted through 0: the cipher adds {slope * 1e9:.3f} s per GB to a hand-off, i.e. "
          f"{1 / slope / 1e9:.3f} GB/s (encrypt and decrypt of one message, one after the other)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
