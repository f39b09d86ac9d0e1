"""Point-to-point ZeroMQ transport between stage processes (no collectives, no object deserialization).

Each process binds one PULL socket (its inbox) and opens one PUSH socket per peer it sends to.
Sends are asynchronous: ZeroMQ queues them without a high-water mark, so a send never blocks and
never drops (the schedule bounds how many micro-batches are in flight, hence the memory).
``recv`` returns the first message matching its filters and keeps the others, in arrival order,
for later calls: a 1F1B stage asks for ``act`` and ``grad`` messages in its own order.

A Transport belongs to one process; its methods may be called from several threads (a lock guards
each socket), but the schedule executor is expected to be the only receiver.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import torch
import zmq

from hetero.errors import WireError

from .wire import Message, decode, encode

log = logging.getLogger(__name__)

_DEFAULT = object()  # "use the transport's recv_timeout_s"
CLOSE_LINGER_S = 10.0  # how long close() waits for queued sends to reach a live peer
_POLL_SLICE_MS = 1000  # wake up periodically so long waits stay interruptible (Ctrl-C)


def _parse_tcp_endpoint(endpoint: str) -> tuple[str, str]:
    """Split ``tcp://host:port`` into (host, port); raises WireError when it is not one."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.netloc or parts.path not in ("", "/"):
        raise WireError(f"endpoint {endpoint!r} is not of the form tcp://HOST:PORT")
    host, sep, port = parts.netloc.rpartition(":")
    if not sep or not host or not (port == "*" or port.isdigit()):
        raise WireError(f"endpoint {endpoint!r} has no port: write tcp://HOST:PORT")
    return host.strip("[]"), port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_address(endpoint: str) -> str:
    """The address to bind for a plan endpoint: itself on loopback, all interfaces otherwise.

    A plan names each stage by the address its peers dial; on a LAN host that address may belong
    to an interface we should not guess at, so bind the port on every interface instead.
    """
    host, port = _parse_tcp_endpoint(endpoint)
    if _is_loopback(host):
        return _join(host, port)
    return f"tcp://*:{port}"


def _join(host: str, port: str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed and localhost pinned to IPv4."""
    if host == "localhost":
        host = "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Transport:
    """One process's inbox (PULL, bound) and outboxes (PUSH, one per peer)."""

    def __init__(self, name: str, bind: str | None, plan_hash: str, *, recv_timeout_s: float | None = 300.0):
        address = bind_address(bind) if bind is not None else None  # validate before opening sockets
        self.name = name
        self.plan_hash = plan_hash
        self.recv_timeout_s = recv_timeout_s
        self._ctx = zmq.Context(io_threads=1)
        self._peers: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._pending: deque[Message] = deque()
        self._pull: zmq.Socket | None = None
        # The address peers dial (the plan's host, port resolved when it was 0); may differ from
        # the bound one, which is every interface for a non-loopback host.
        self.endpoint: str | None = None
        self._closed = False
        if bind is not None and address is not None:
            pull = self._ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, 0)  # never drop or stall on the receive side
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.IPV6, 1)
            host, port = _parse_tcp_endpoint(address)
            try:
                if port in ("0", "*"):
                    port = str(pull.bind_to_random_port(_join(host, "0").rsplit(":", 1)[0]))
                else:
                    pull.bind(address)
                self.endpoint = _join(_parse_tcp_endpoint(bind)[0], port)
            except zmq.ZMQError as exc:
                pull.close(linger=0)
                self._ctx.term()
                raise WireError(
                    f"{name} cannot listen on {address} ({exc.strerror}): is another process using "
                    "that port? stop it or recompile with another base port"
                ) from None
            self._pull = pull

    # -- outbound ---------------------------------------------------------------------------------

    def connect(self, peer: str, endpoint: str) -> None:
        """Open the outbound socket to ``peer``; messages queue until the peer is up (no handshake)."""
        self._check_open()
        host, port = _parse_tcp_endpoint(endpoint)
        if not port.isdigit() or int(port) == 0:
            raise WireError(f"cannot connect {self.name} to {peer} at {endpoint!r}: it needs a concrete port")
        with self._send_lock:
            if peer in self._peers:
                # Re-pointing a peer (it restarted elsewhere): the old socket still flushes its queue.
                self._peers.pop(peer).close()
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)  # unlimited queue: a send never blocks nor drops
            push.setsockopt(zmq.LINGER, int(CLOSE_LINGER_S * 1000))
            push.setsockopt(zmq.TCP_KEEPALIVE, 1)  # notice a peer host that vanished
            push.setsockopt(zmq.IPV6, 1)  # harmless for IPv4 peers; needed for [::1]-style endpoints
            push.connect(_join(host, port))
            self._peers[peer] = push

    def send(self, peer: str, kind: str, *, step: int = 0, mb: int = -1,
             tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None) -> None:
        """Queue a message to ``peer`` and return at once.

        Tensors go out zero-copy from their own memory (GPU tensors are first copied to CPU here):
        do not modify a sent tensor in place afterwards.
        """
        self._check_open()
        msg = Message(kind=kind, sender=self.name, step=step, mb=mb, meta=meta or {}, tensors=tensors or {})
        frames = encode(msg, self.plan_hash)
        with self._send_lock:
            sock = self._peers.get(peer)
            if sock is None:
                known = ", ".join(sorted(self._peers)) or "none"
                raise WireError(f"{self.name} has no connection to {peer!r} (connected: {known}): connect() it first")
            # copy=False: ZeroMQ keeps a reference to each memoryview (hence the tensor) until sent.
            sock.send_multipart(frames, copy=False)

    # -- inbound ----------------------------------------------------------------------------------

    def recv(self, kind: str | None = None, *, step: int | None = None, mb: int | None = None,
             sender: str | None = None, timeout_s: float | None | Any = _DEFAULT) -> Message:
        """The first message (pending or new) matching every given filter; others are kept for later.

        ``timeout_s`` defaults to the transport's ``recv_timeout_s``; ``None`` waits forever. A
        malformed or foreign message raises WireError (it is discarded; queued messages are kept).
        """
        self._check_open()
        if self._pull is None:
            raise WireError(f"{self.name} was created without a bind address and cannot receive")
        timeout: float | None = self.recv_timeout_s if timeout_s is _DEFAULT else timeout_s
        deadline = None if timeout is None else time.monotonic() + float(timeout)

        def matches(m: Message) -> bool:
            return ((kind is None or m.kind == kind) and (step is None or m.step == step)
                    and (mb is None or m.mb == mb) and (sender is None or m.sender == sender))

        with self._recv_lock:
            for i, queued in enumerate(self._pending):
                if matches(queued):
                    del self._pending[i]
                    return queued
            while True:
                if deadline is None or timeout is None:
                    wait_ms = _POLL_SLICE_MS
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise WireError(self._timeout_message(kind, step, mb, sender, timeout))
                    wait_ms = min(_POLL_SLICE_MS, max(1, int(remaining * 1000)))
                if not self._pull.poll(wait_ms, zmq.POLLIN):
                    continue
                frames = self._pull.recv_multipart(copy=False)
                msg = decode(frames, self.plan_hash)  # WireError propagates; the bad message is gone
                if matches(msg):
                    return msg
                self._pending.append(msg)

    def _timeout_message(self, kind: str | None, step: int | None, mb: int | None,
                         sender: str | None, timeout: float) -> str:
        what = f"{kind!r}" if kind is not None else "message"
        if step is not None:
            what += f" step {step}"
        if mb is not None:
            what += f" mb {mb}"
        source = f"from {sender}" if sender is not None else "from any peer"
        hint = "is that stage alive? see its log" if sender is not None else "are the other stages alive? see their logs"
        return f"no {what} {source} within {timeout:g} s: {hint}"

    def pending(self) -> int:
        """How many received messages wait for a matching recv (diagnostics)."""
        return len(self._pending)

    # -- lifecycle --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise WireError(f"transport {self.name} is closed")

    def close(self) -> None:
        """Flush queued sends (up to CLOSE_LINGER_S per peer socket) and release every socket."""
        if self._closed:
            return
        self._closed = True
        with self._send_lock:
            for sock in self._peers.values():
                sock.close()  # uses the socket's LINGER: queued messages still go out
            self._peers.clear()
        with self._recv_lock:
            if self._pull is not None:
                self._pull.close(linger=0)
            self._pending.clear()
        self._ctx.term()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Transport({self.name!r}, endpoint={self.endpoint!r}, peers={sorted(self._peers)})"
