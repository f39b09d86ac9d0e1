"""Point-to-point ZeroMQ transport between stage processes (no collectives, no object deserialization).

Each process binds one PULL socket (its inbox) and opens one PUSH socket per peer it sends to.
Sends are asynchronous: ZeroMQ queues them without a high-water mark, so a send never blocks and
never drops (the schedule bounds how many micro-batches are in flight, hence the memory).
``recv`` returns the first message matching its filters and keeps the others, in arrival order,
for later calls: a 1F1B stage asks for ``act`` and ``grad`` messages in its own order.

Who may talk (hetero/security.py): with an ``Identity`` the inbox is a CurveZMQ server (or, on one
machine, a ZeroMQ PLAIN server with per-process tokens) whose ZAP handler (runtime/wire/gatekeeper.py)
admits only the run's own processes; a connection from anyone else is refused during the ZeroMQ handshake and logged, and
never reaches ``recv``. A message's sender is the authenticated peer: a header claiming another
name is dropped. Every received message is then checked (frames.decode, then ``Rules`` from
runtime/wire/rules.py); one that fails is logged with its peer and dropped, and ``recv`` goes on
waiting for the real peers. ``max_message_bytes`` sets ZeroMQ's MAXMSGSIZE, so an oversized
message is cut off by ZeroMQ before it is held in memory. A connection that never finishes the
handshake is dropped after inbox.INBOX_HANDSHAKE_S, and an inbox that runs out of descriptors logs it once
and goes on (inbox.py ``_limit_connections``, gatekeeper.InboxWatch): a flood of idle connections does not stop a run.

What may be sent is hetero/protocol.py: ``send`` takes a record (``Clip(coef=.., grad_norm=..)``: the
message's kind and meta) or a kind's name (messages of tensors only), and refuses a kind the protocol
does not define.

The receiving side is runtime/wire/inbox.py's ``Inbox`` (the socket, its checks, the messages kept for later);
endpoints are parsed and resolved in runtime/wire/endpoints.py. A Transport belongs to one process; its methods may be called from several threads (a lock guards
each socket), but the schedule executor is expected to be the only receiver.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import zmq

from hetero.errors import WireError
from hetero.protocol import Record, record_type
from hetero.runtime.wire.endpoints import _join, _parse_tcp_endpoint, bind_address
from hetero.runtime.wire.frames import Message, encode
from hetero.runtime.wire.inbox import _DEFAULT, Inbox
from hetero.security import Identity

log = logging.getLogger(__name__)

CLOSE_LINGER_S = 10.0  # how long close() waits for queued sends to reach a live peer
# A send finds no pipe to its peer only when ZeroMQ gave up on the connection: the handshake failed
# (another program holds the peer's port, or it refused our key). Wait this long, then fail.
SEND_STALL_S = 5.0


class Transport:
    """One process's inbox (PULL, bound) and outboxes (PUSH, one per peer)."""

    def __init__(self, name: str, bind: str | None, plan_hash: str, *, recv_timeout_s: float | None = 300.0,
                 identity: Identity | None = None, peer_keys: dict[str, str] | None = None,
                 max_message_bytes: int | None = None, rules: Any = None):
        address = bind_address(bind) if bind is not None else None  # validate before opening sockets
        self.name = name
        self.plan_hash = plan_hash
        self.identity = identity
        self.peer_keys = dict(peer_keys or {})
        if identity is not None and identity.mode == "curve" and set(self.peer_keys) == set():
            raise WireError(f"{name}: CURVE needs the plan's public keys")
        self._ctx = zmq.Context(io_threads=1)
        # rules: runtime.wire.rules.Rules, or None: every well-formed message is accepted
        self.inbox = Inbox(self._ctx, name, plan_hash, identity, self.peer_keys, rules, recv_timeout_s)
        self._peers: dict[str, zmq.Socket] = {}
        self._monitors = 0  # monitors started so far (each gets its own inproc address)
        # With watch_from_start(events): each connect() starts a monitor first, so that no event of the very
        # first connection attempt is lost (ZeroMQ does not retry a connection whose key was refused).
        self._watch_events = 0
        self._early: dict[str, zmq.Socket] = {}
        self._endpoints: dict[str, str] = {}  # peer -> the endpoint it was connected at (for errors)
        self._send_lock = threading.Lock()
        self._closed = False
        if bind is not None and address is not None:
            self.inbox.listen(bind, address, max_message_bytes)

    # The inbox's state, read (and its rules' step set) by the run's processes and tests.
    endpoint = property(lambda self: self.inbox.endpoint, doc="the address peers dial (None: no inbox)")
    rules = property(lambda self: self.inbox.rules, doc="the checks every received message passes")
    rejected = property(lambda self: self.inbox.rejected, doc="messages dropped by the checks so far")
    rejections = property(lambda self: self.inbox.rejections, doc="(claimed sender, why) of the newest drops")
    _gate = property(lambda self: self.inbox._gate, doc="the inbox's watch (a Gatekeeper with keys)")

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
            self._secure_client(push, peer)
            if self._watch_events:
                self._early[peer] = self._start_monitor(push, peer, self._watch_events)
            push.connect(_join(host, port))
            self._peers[peer] = push
            self._endpoints[peer] = endpoint

    def _secure_client(self, push: zmq.Socket, peer: str) -> None:
        """Present this process's key (or token) to ``peer``'s inbox; CURVE also checks the peer's key."""
        ident = self.identity
        if ident is None:
            return
        if ident.mode == "curve":
            server = self.peer_keys.get(peer)
            if server is None:
                push.close(linger=0)
                raise WireError(f"{self.name} has no public key for {peer!r}: plan.json lacks it (recompile, "
                                "or `hetero keys plan.json`)")
            push.curve_secretkey = ident.secret.encode("ascii")
            push.curve_publickey = ident.public.encode("ascii")
            push.curve_serverkey = server.encode("ascii")
        else:
            push.plain_username = ident.name.encode()
            push.plain_password = ident.token_for(peer).encode()  # a password per peer (hetero/security.py)

    def send(self, peer: str, kind: str | Record, *, step: int = 0, mb: int = -1,
             tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None,
             plan_hash: str | None = None) -> None:
        """Queue a message to ``peer`` and return at once (under ``plan_hash``, default this process's plan: the
        coordinator tells a stage of another plan of its run to follow the current one, runtime/run/elastic.py).

        ``kind`` is a hetero.protocol record (``Clip(coef=..., grad_norm=...)``: the kind and its meta)
        or a kind's name (a message of tensors only); a kind the protocol does not define is refused. Tensors go out zero-copy from their own memory (GPU tensors are first copied to CPU
        here): do not modify a sent tensor in place afterwards.
        """
        self._check_open()
        if isinstance(kind, Record):
            if meta is not None:
                raise WireError(f"{self.name}: a {kind.KIND!r} record is the message's meta; pass no meta= with it")
            kind_name, meta = kind.KIND, kind.to_wire()
        else:
            kind_name = kind
        kind = kind_name
        record_type(kind)  # refuses a kind the protocol does not define
        msg = Message(kind=kind, sender=self.name, step=step, mb=mb, meta=meta or {}, tensors=tensors or {})
        frames = encode(msg, plan_hash or self.plan_hash)
        deadline = time.monotonic() + SEND_STALL_S
        while True:
            with self._send_lock:
                sock = self._peers.get(peer)
                if sock is None:
                    known = ", ".join(sorted(self._peers)) or "none"
                    raise WireError(f"{self.name} has no connection to {peer!r} (connected: {known}): "
                                    "connect() it first")
                try:
                    # copy=False: ZeroMQ keeps a reference to each memoryview (hence the tensor) until sent.
                    # NOBLOCK: the queue is unbounded, so only a connection ZeroMQ gave up on can block,
                    # and a blocked send would hold this lock (and every other sender) forever.
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    pass
            if time.monotonic() > deadline:
                where = self._endpoints.get(peer, "its address")
                raise WireError(f"{self.name} cannot send to {peer} at {where}: ZeroMQ has no working connection "
                                f"after {SEND_STALL_S:g} s (the handshake failed: is another program using that "
                                "port, or does the peer refuse this process's key?)")
            time.sleep(0.05)

    def set_linger(self, linger_ms: int, peers: list[str] | None = None) -> None:
        """How long close() may wait for queued sends to ``peers`` (default: every peer) to go out.

        For peers that exited or refused us, which will never take what is queued for them."""
        with self._send_lock:
            for peer, sock in self._peers.items():
                if peers is None or peer in peers:
                    sock.setsockopt(zmq.LINGER, int(linger_ms))

    def monitor(self, peer: str, events: int) -> zmq.Socket | None:
        """A ZeroMQ monitor socket for ``events`` of the outbound connection to ``peer`` (None if not connected).

        The caller owns it and must close it before this Transport closes. A socket has one monitor at a time: a new
        one replaces the last (each at its own address: libzmq frees a stopped monitor's address only later)."""
        with self._send_lock:
            early = self._early.pop(peer, None)
            if early is not None:
                return early
            sock = self._peers.get(peer)
            return None if sock is None else self._start_monitor(sock, peer, events)

    def watch_from_start(self, events: int) -> None:
        """Peers connected from now on are monitored for ``events`` before their first connection attempt; the
        first ``monitor(peer, ...)`` call returns that monitor."""
        self._watch_events = events

    def _start_monitor(self, sock: zmq.Socket, peer: str, events: int) -> zmq.Socket:
        self._monitors += 1
        address = f"inproc://monitor.{id(self)}.{peer}.{self._monitors}"
        sock.monitor(address, events)
        watcher = self._ctx.socket(zmq.PAIR)
        watcher.connect(address)
        return watcher

    def unmonitor(self, peer: str) -> None:
        """Stop the monitor of the outbound connection to ``peer`` (if any), so that another may start."""
        with self._send_lock:
            sock = self._peers.get(peer)
            if sock is not None and not sock.closed:
                sock.monitor(None, 0)

    # -- inbound ----------------------------------------------------------------------------------

    def recv(self, kind: str | None = None, *, step: int | None = None, mb: int | None = None,
             sender: str | None = None, timeout_s: float | None | Any = _DEFAULT, chunk: int | None = None) -> Message:
        """The first message (pending or new) matching every given filter; others are kept for later (Inbox.recv).

        ``timeout_s`` defaults to the transport's ``recv_timeout_s``; ``None`` waits forever. A malformed, foreign,
        spoofed or unexpected message is logged and dropped (see ``rejections``); the wait goes on."""
        self._check_open()
        return self.inbox.recv(kind, step=step, mb=mb, sender=sender, timeout_s=timeout_s, chunk=chunk)

    def last_rejection(self, sender: str | None = None) -> str | None:
        """The newest drop reason (of messages claiming ``sender``, if given), for error messages."""
        return self.inbox.last_rejection(sender)

    def refused_handshakes(self) -> int:
        """How many connections the inbox refused at the ZeroMQ handshake so far (diagnostics)."""
        return self.inbox.refused_handshakes()

    def refused_peers(self) -> list[str]:
        """The peer addresses of the inbox's logged refusals that it could name, newest last (diagnostics)."""
        return self.inbox.refused_peers()

    def pending(self) -> int:
        """How many received messages wait for a matching recv (diagnostics)."""
        return self.inbox.pending()



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
            for watcher in self._early.values():
                watcher.close(linger=0)
            self._early.clear()
            for sock in self._peers.values():
                sock.close()  # uses the socket's LINGER: queued messages still go out
            self._peers.clear()
        self.inbox.close()
        self._ctx.term()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Transport({self.name!r}, endpoint={self.endpoint!r}, peers={sorted(self._peers)})"
