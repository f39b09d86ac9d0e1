"""One process's inbox: the bound PULL socket behind its gatekeeper, the checks every received message passes,
and the messages received but not yet asked for (runtime/wire/transport.py's receiving side).

Who may talk (hetero/security.py): with an ``Identity`` the inbox is a CurveZMQ server (or, on one machine, a
ZeroMQ PLAIN server with per-process tokens) whose ZAP handler (runtime/wire/gatekeeper.py) admits only the run's
own processes. A message's sender is the authenticated peer: a header claiming another name is dropped. Every
received message is then checked (frames.decode, then ``Rules`` from runtime/wire/rules.py); one that fails is
logged with its peer and dropped, and ``recv`` goes on waiting for the real peers.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from typing import Any

import zmq

from hetero.errors import WireError
from hetero.runtime.wire.endpoints import _join, _parse_tcp_endpoint
from hetero.runtime.wire.frames import Message, chunk_of, decode, plan_mismatch
from hetero.runtime.wire.gatekeeper import Gatekeeper, InboxWatch
from hetero.security import Identity

log = logging.getLogger("hetero.runtime.wire.transport")

_DEFAULT = object()  # "use the transport's recv_timeout_s"
BIND_RETRY_S = 5.0  # a port in use is tried again this long: see _bind_retrying
_POLL_SLICE_MS = 1000  # wake up periodically so long waits stay interruptible (Ctrl-C)
_PART_WAIT_MS = 2000  # a message's later frames are normally there with its first
# An inbox drops a connection that has not finished the ZeroMQ handshake (key or token checked) this
# long after it was accepted: an idle connection from anyone who can reach the port holds a descriptor
# only that long (ZeroMQ's default is 30 s). A real peer's handshake is a few small messages: far
# less than this even over a slow link, and a peer cut off by it reconnects on its own.
INBOX_HANDSHAKE_S = 10.0
# TCP keepalive on an inbox's connections: one whose host vanished (power cut, pulled cable) without
# closing it is dropped after about IDLE + COUNT x INTERVAL s instead of the kernel's 2 hours.
INBOX_KEEPALIVE_IDLE_S, INBOX_KEEPALIVE_INTERVAL_S, INBOX_KEEPALIVE_COUNT = 60, 10, 3


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


class Inbox:
    """The receiving side of a Transport (module docstring); ``listen`` binds it, ``recv`` takes from it."""

    def __init__(self, ctx: zmq.Context, name: str, plan_hash: str, identity: Identity | None,
                 peer_keys: dict[str, str], rules: Any, recv_timeout_s: float | None) -> None:
        self._ctx, self.name, self.plan_hash = ctx, name, plan_hash
        self.identity, self.peer_keys, self.rules = identity, peer_keys, rules
        self.recv_timeout_s = recv_timeout_s
        self.rejected = 0  # messages dropped by the checks (diagnostics)
        self.rejections: deque[tuple[str, str]] = deque(maxlen=20)  # (claimed sender, why), newest last
        # A coordinator's: (plans the run went through before, its stages' names now). A stage of an earlier plan
        # whose name the run no longer has is a lost device coming back (runtime/run/elastic.py decides whether to
        # take it back, and says so); one the run has sent it before the run went on under this plan. Their messages
        # are dropped and kept as rejections, but logged as what they are (once each), not as another plan.json.
        self.returning: tuple[set[str], set[str]] = (set(), set())
        self._returned: set[tuple[str, str]] = set()  # (name, plan) of those logged so, once each
        self._warned = 0  # drops warned about (or counted towards the next warning)
        self._gate: InboxWatch | None = None  # the inbox's watch (a Gatekeeper when the run has keys)
        self._recv_lock = threading.Lock()
        self._pending: deque[Message] = deque()
        self._pull: zmq.Socket | None = None
        # The address peers dial (the plan's host, port resolved when it was 0); may differ from
        # the bound one, which is every interface for a non-loopback host.
        self.endpoint: str | None = None

    def listen(self, bind: str, address: str, max_message_bytes: int | None) -> None:
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
                _bind_retrying(pull, address)
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

    def recv(self, kind: str | None = None, *, step: int | None = None, mb: int | None = None,
             sender: str | None = None, timeout_s: float | None | Any = _DEFAULT, chunk: int | None = None) -> Message:
        """The first message (pending or new) matching every given filter; others are kept for later.
        ``chunk``: an act or grad for that chunk of an interleaved device (its meta's ``chunk``, absent: 0).

        ``timeout_s`` defaults to the transport's ``recv_timeout_s``; ``None`` waits forever. A
        malformed, foreign, spoofed or unexpected message is logged and dropped (see ``rejections``);
        the wait goes on.
        """
        if self._pull is None:
            raise WireError(f"{self.name} was created without a bind address and cannot receive")
        timeout: float | None = self.recv_timeout_s if timeout_s is _DEFAULT else timeout_s
        deadline = None if timeout is None else time.monotonic() + float(timeout)

        def matches(m: Message) -> bool:
            return ((kind is None or m.kind == kind) and (step is None or m.step == step)
                    and (mb is None or m.mb == mb) and (sender is None or m.sender == sender)
                    and (chunk is None or chunk_of(m) == chunk))

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
            self.rejected += 1  # (the coordinator looks for a lost device coming back when this grows)
            peer = user or _peer_address(frames[0])
            self.rejections.append((peer, str(exc)))
            if (earlier := self._of_an_earlier_plan(peer, str(exc))) is not None:  # its hello, then a heartbeat a
                if earlier not in self._returned:  # second; or what a stage sent before the run's last switch
                    self._returned.add(earlier)
                    if earlier[0] in self.returning[1]:
                        log.info("%s: %s's messages under plan %s, an earlier plan of this run, sent before the run "
                                 "went on under this one, are dropped", self.name, *earlier)
                    else:
                        log.info("%s: %s says hello under plan %s, an earlier plan of this run: a lost device coming "
                                 "back (taken back at a step boundary where that is faster)", self.name, *earlier)
                return None
            self._warned += 1  # the first 20 drops of other kinds are each told, then one in 1000
            if self._warned <= 20 or self._warned % 1000 == 0:
                log.warning("%s dropped a message from %s: %s (%d dropped so far)", self.name, peer, exc,
                            self.rejected)
            return None
        return msg

    def _of_an_earlier_plan(self, peer: str, why: str) -> tuple[str, str] | None:
        """(its name, its plan) when ``why`` drops a message of an earlier plan of the run: from a stage the run lost,
        a device coming back; from a stage of this plan, one it sent before the run went on under this plan (a
        rejoin, a re-plan). Neither is a host of another plan.json."""
        earlier, _ = self.returning
        mismatch = plan_mismatch(why) if earlier else None
        if mismatch is None or mismatch[1] not in earlier:
            return None
        return (peer if self.identity is not None else mismatch[0], mismatch[1])  # with keys: the name its key proves

    def _timeout_message(self, kind: str | None, step: int | None, mb: int | None,
                         sender: str | None, timeout: float) -> str:
        what = f"{kind!r}" if kind is not None else "message"
        if step is not None:
            what += f" step {step}"
        if mb is not None:
            what += f" mb {mb}"
        source = f"from {sender}" if sender is not None else "from any peer"
        if sender is None:
            hint = "are the other stages alive? see logs/stage<k>.log in each host's run directory"
        elif re.fullmatch(r"stage\d+", sender):
            hint = f"is that stage alive? see logs/{sender}.log in its host's run directory"
        else:
            hint = f"is {sender} alive? see its log"
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

    def close(self) -> None:
        with self._recv_lock:
            if self._pull is not None:
                self._pull.close(linger=0)
            self._pending.clear()
        if self._gate is not None:
            self._gate.stop()


def _bind_retrying(sock: zmq.Socket, address: str, within_s: float = BIND_RETRY_S) -> None:
    """Bind ``address``, trying again for ``within_s`` while the port is in use: the process that held it (this
    stage under the run's plan before a re-plan) may still be closing. (A port a peer was handed as its own, and
    connected to itself on, stays taken for a minute: preflight.warn_ephemeral says how to avoid that.)"""
    deadline = time.monotonic() + within_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(0.1)
