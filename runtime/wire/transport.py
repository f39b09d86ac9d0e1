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
handshake is dropped after INBOX_HANDSHAKE_S, and an inbox that runs out of descriptors logs it once
and goes on (``_limit_connections``, gatekeeper.InboxWatch): a flood of idle connections does not stop a run.

What may be sent is hetero/protocol.py: ``send`` takes a record (``Clip(coef=.., grad_norm=..)``: the
message's kind and meta) or a kind's name (messages of tensors only), and refuses a kind the protocol
does not define.

A Transport belongs to one process; its methods may be called from several threads (a lock guards
each socket), but the schedule executor is expected to be the only receiver.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import torch
import zmq

from hetero.errors import WireError
from hetero.protocol import Record, record_type
from hetero.runtime.wire.frames import Message, decode, encode
from hetero.runtime.wire.gatekeeper import Gatekeeper, InboxWatch
from hetero.security import Identity

log = logging.getLogger(__name__)

_DEFAULT = object()  # "use the transport's recv_timeout_s"
CLOSE_LINGER_S = 10.0  # how long close() waits for queued sends to reach a live peer
_POLL_SLICE_MS = 1000  # wake up periodically so long waits stay interruptible (Ctrl-C)
# A send finds no pipe to its peer only when ZeroMQ gave up on the connection: the handshake failed
# (another program holds the peer's port, or it refused our key). Wait this long, then fail.
SEND_STALL_S = 5.0
_PART_WAIT_MS = 2000  # a message's later frames are normally there with its first
# An inbox drops a connection that has not finished the ZeroMQ handshake (key or token checked) this
# long after it was accepted: an idle connection from anyone who can reach the port holds a descriptor
# only that long (ZeroMQ's default is 30 s). A real peer's handshake is a few small messages: far
# less than this even over a slow link, and a peer cut off by it reconnects on its own.
INBOX_HANDSHAKE_S = 10.0
# TCP keepalive on an inbox's connections: one whose host vanished (power cut, pulled cable) without
# closing it is dropped after about IDLE + COUNT x INTERVAL s instead of the kernel's 2 hours.
INBOX_KEEPALIVE_IDLE_S, INBOX_KEEPALIVE_INTERVAL_S, INBOX_KEEPALIVE_COUNT = 60, 10, 3


def _parse_tcp_endpoint(endpoint: str) -> tuple[str, str]:
    """Split ``tcp://host:port`` into (host, port); raises WireError when it is not one."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.netloc or parts.path not in ("", "/"):
        raise WireError(f"endpoint {endpoint!r} is not of the form tcp://HOST:PORT")
    host, sep, port = parts.netloc.rpartition(":")
    if not sep or not host or not (port == "*" or port.isdigit()):
        raise WireError(f"endpoint {endpoint!r} has no port: write tcp://HOST:PORT")
    return host.strip("[]"), port


def bind_address(endpoint: str) -> str:
    """The address to bind for a plan endpoint: exactly the plan's address (never every interface).

    A stage listens only where the plan says its peers reach it, so a host with a second network
    (the internet, a guest Wi-Fi) does not expose the port there.
    """
    host, port = _parse_tcp_endpoint(endpoint)
    if host != "localhost" and not _is_ip(host):
        try:  # ZeroMQ binds interfaces and addresses, not host names
            host = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        except (OSError, IndexError):
            raise WireError(f"cannot resolve {host!r} of {endpoint!r} to one of this host's addresses: "
                            "write the host's IP address in the fleet file") from None
    return _join(host, port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _peer_address(frame: Any) -> str:
    try:
        return f"unauthenticated peer {frame.get('Peer-Address')}"
    except (zmq.ZMQError, AttributeError):
        return "unauthenticated peer"


def _limit_connections(inbox: zmq.Socket) -> None:
    """What ZeroMQ offers against connections that hold an inbox's descriptors without ever joining the run.

    With every process's open-file limit raised to the hard limit (processes.raise_open_file_limit), an
    unauthenticated connection costs a descriptor for INBOX_HANDSHAKE_S at most, and ZAP refuses a wrong key
    at once (gatekeeper.py). libzmq has no per-peer connection cap, and its MAX_SOCKETS counts a context's
    sockets, not connections; TCP_ACCEPT_FILTER (deprecated) would admit by source address, which the plan
    cannot promise (multi-homed hosts, NAT) and which a flood from a fleet host passes anyway.
    """
    inbox.setsockopt(zmq.HANDSHAKE_IVL, int(INBOX_HANDSHAKE_S * 1000))
    inbox.setsockopt(zmq.TCP_KEEPALIVE, 1)
    inbox.setsockopt(zmq.TCP_KEEPALIVE_IDLE, INBOX_KEEPALIVE_IDLE_S)
    inbox.setsockopt(zmq.TCP_KEEPALIVE_INTVL, INBOX_KEEPALIVE_INTERVAL_S)
    inbox.setsockopt(zmq.TCP_KEEPALIVE_CNT, INBOX_KEEPALIVE_COUNT)


def _join(host: str, port: str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed and localhost pinned to IPv4."""
    if host == "localhost":
        host = "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Transport:
    """One process's inbox (PULL, bound) and outboxes (PUSH, one per peer)."""

    def __init__(self, name: str, bind: str | None, plan_hash: str, *, recv_timeout_s: float | None = 300.0,
                 identity: Identity | None = None, peer_keys: dict[str, str] | None = None,
                 max_message_bytes: int | None = None, rules: Any = None):
        address = bind_address(bind) if bind is not None else None  # validate before opening sockets
        self.name = name
        self.plan_hash = plan_hash
        self.recv_timeout_s = recv_timeout_s
        self.identity = identity
        self.peer_keys = dict(peer_keys or {})
        self.rules = rules  # runtime.wire.rules.Rules, or None: every well-formed message is accepted
        self.rejected = 0  # messages dropped by the checks (diagnostics)
        self.rejections: deque[tuple[str, str]] = deque(maxlen=20)  # (claimed sender, why), newest last
        if identity is not None and identity.mode == "curve" and set(self.peer_keys) == set():
            raise WireError(f"{name}: CURVE needs the plan's public keys")
        self._ctx = zmq.Context(io_threads=1)
        self._gate: InboxWatch | None = None  # the inbox's watch (a Gatekeeper when the run has keys)
        self._peers: dict[str, zmq.Socket] = {}
        self._monitors = 0  # monitors started so far (each gets its own inproc address)
        # With watch_from_start(events): each connect() starts a monitor first, so that no event of the very
        # first connection attempt is lost (ZeroMQ does not retry a connection whose key was refused).
        self._watch_events = 0
        self._early: dict[str, zmq.Socket] = {}
        self._endpoints: dict[str, str] = {}  # peer -> the endpoint it was connected at (for errors)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._pending: deque[Message] = deque()
        self._pull: zmq.Socket | None = None
        # The address peers dial (the plan's host, port resolved when it was 0); may differ from
        # the bound one, which is every interface for a non-loopback host.
        self.endpoint: str | None = None
        self._closed = False
        if bind is not None and address is not None:
            self._pull = self._listen(bind, address, max_message_bytes)

    def _inbox(self, max_message_bytes: int | None) -> zmq.Socket:
        """The inbox's PULL socket, behind the gatekeeper (started here) when the run has keys."""
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)  # never drop or stall on the receive side
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.IPV6, 1)
        if max_message_bytes is not None:
            pull.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))  # ZeroMQ drops the connection
        _limit_connections(pull)
        identity = self.identity
        self._gate = (InboxWatch(self.name) if identity is None
                      else Gatekeeper(self._ctx, self.name, identity, self.peer_keys))
        self._gate.watch(pull)  # failed handshakes and accepts are logged, in every mode
        self._gate.start()
        if identity is not None:
            pull.setsockopt(zmq.ZAP_DOMAIN, b"hetero")
            if identity.mode == "curve":
                pull.curve_server = True
                pull.curve_secretkey = identity.secret.encode("ascii")
                pull.curve_publickey = identity.public.encode("ascii")
            else:
                pull.plain_server = True
        return pull

    def _listen(self, bind: str, address: str, max_message_bytes: int | None) -> zmq.Socket:
        """Bind the inbox at ``address`` (a free port for port 0) and set ``endpoint``; one-line WireError if not."""
        pull = self._inbox(max_message_bytes)
        host, port = _parse_tcp_endpoint(address)
        try:
            if port in ("0", "*"):
                port = str(pull.bind_to_random_port(_join(host, "0").rsplit(":", 1)[0]))
            else:
                pull.bind(address)
            self.endpoint = _join(_parse_tcp_endpoint(bind)[0], port)
            if self._gate is not None:
                self._gate.listening(int(port))
        except zmq.ZMQError as exc:
            pull.close(linger=0)
            if self._gate is not None:
                self._gate.stop()
            self._ctx.term()
            hint = ("is another process using that port? stop it or recompile with another base port"
                    if exc.errno == zmq.EADDRINUSE else
                    "is that address one of this host's? check the host's address in the fleet file")
            raise WireError(f"{self.name} cannot listen on {address} ({exc.strerror}): {hint}") from None
        return pull

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
            kind, meta = kind.KIND, kind.to_wire()
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
             sender: str | None = None, timeout_s: float | None | Any = _DEFAULT) -> Message:
        """The first message (pending or new) matching every given filter; others are kept for later.

        ``timeout_s`` defaults to the transport's ``recv_timeout_s``; ``None`` waits forever. A
        malformed, foreign, spoofed or unexpected message is logged and dropped (see ``rejections``);
        the wait goes on.
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
                frames = self._read_frames()
                if frames is None:
                    continue
                msg = self._admit(frames)
                if msg is None:
                    continue
                if matches(msg):
                    return msg
                if msg.kind == "heartbeat":  # only the newest heartbeat of a peer matters
                    self._pending = deque(m for m in self._pending
                                          if not (m.kind == "heartbeat" and m.sender == msg.sender))
                self._pending.append(msg)

    def _read_frames(self) -> list[Any] | None:
        """One message's frames, never blocking. A connection that ZeroMQ cut mid-message (MAXMSGSIZE
        exceeded) can leave the first frames readable and the rest never coming: wait a little for
        each, then drop what came."""
        assert self._pull is not None
        try:
            frames = [self._pull.recv(zmq.NOBLOCK, copy=False)]
        except zmq.Again:
            return None
        while frames[-1].more:
            deadline = time.monotonic() + _PART_WAIT_MS / 1000
            while True:
                try:
                    frames.append(self._pull.recv(zmq.NOBLOCK, copy=False))
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        self.rejected += 1
                        why = f"a message was cut off after {len(frames)} frame(s): larger than the plan allows?"
                        self.rejections.append(("?", why))
                        log.warning("%s dropped %s", self.name, why)
                        return None
                    self._pull.poll(50, zmq.POLLIN)
        return frames

    def _admit(self, frames: list[Any]) -> Message | None:
        """Decode and check one received message; None (logged) when it is dropped."""
        user = None
        if self.identity is not None:
            try:
                user = frames[0].get("User-Id")
            except (zmq.ZMQError, AttributeError):  # bytes frames (tests) carry no metadata
                user = None
        try:
            msg = decode(frames, self.plan_hash)
            if self.identity is not None and msg.sender != user:
                raise WireError(f"{msg.describe()}: the peer authenticated as {user!r}, not {msg.sender!r}")
            if self.rules is not None:
                self.rules.check(msg, list(self._pending))
        except WireError as exc:
            self.rejected += 1
            peer = user or _peer_address(frames[0])
            self.rejections.append((peer, str(exc)))
            if self.rejected <= 20 or self.rejected % 1000 == 0:
                log.warning("%s dropped a message from %s: %s (%d dropped so far)", self.name, peer, exc,
                            self.rejected)
            return None
        return msg

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

    def last_rejection(self, sender: str | None = None) -> str | None:
        """The newest drop reason (of messages claiming ``sender``, if given), for error messages."""
        for peer, why in reversed(self.rejections):
            if sender is None or peer == sender or re.search(rf"\b{re.escape(sender)}\b", why):
                return why
        return None

    def refused_handshakes(self) -> int:
        """How many connections the inbox refused at the ZeroMQ handshake so far (diagnostics)."""
        return self._gate.refused if self._gate is not None else 0

    def refused_peers(self) -> list[str]:
        """The peer addresses of the inbox's logged refusals that it could name, newest last (diagnostics)."""
        return list(self._gate.refused_from) if self._gate is not None else []

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
            for watcher in self._early.values():
                watcher.close(linger=0)
            self._early.clear()
            for sock in self._peers.values():
                sock.close()  # uses the socket's LINGER: queued messages still go out
            self._peers.clear()
        with self._recv_lock:
            if self._pull is not None:
                self._pull.close(linger=0)
            self._pending.clear()
        if self._gate is not None:
            self._gate.stop()
        self._ctx.term()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Transport({self.name!r}, endpoint={self.endpoint!r}, peers={sorted(self._peers)})"
