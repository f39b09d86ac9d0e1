"""The watch on a process's inbox, and its ZAP handler: admits a connection only with one of the run's keys (or tokens).

ZeroMQ asks the context's ZAP handler (RFC 27) during each handshake on a CURVE or PLAIN server
socket; a peer that is not one of the run's processes is refused there, before any of its bytes
reach the Transport, and the refusal is logged with its address. In every mode (keys or none) the
inbox's ZeroMQ monitor is read too: handshakes that fail before ZAP is asked (their peer looked up in
the kernel's table of connections just closed, runtime/wire/closed_peers.py), and connections the
process could not accept (no descriptor left: a flood of idle connections), are logged, and the run
goes on.
"""

from __future__ import annotations

import errno
import hmac
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message  # imported now: with no descriptor left, no import works

from hetero.runtime.wire.closed_peers import ClosedPeers
from hetero.security import Identity, token_verifier

log = logging.getLogger("hetero.runtime.wire.transport")  # refusals log beside the transport's drops
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
# A flood refuses thousands of connections a second, and while a process has no descriptor left libzmq
# retries accept() (and reports each failure) as fast as it can: after the first lines, one line per
# this many seconds, with the count so far.
LOG_EVERY_S = 30.0
_LOGGED_IN_FULL = 10  # the first refusals are each logged
# libzmq's I/O thread blocks (every connection of the process with it) once the monitor's queue is
# full: each wake-up reads up to this many events before it looks at the ZAP socket and stop() again.
_MONITOR_BATCH = 1000
_POLL_MS = 200  # how soon stop() is seen


def _failure(event: int, value: int) -> str:
    """What a failed handshake on an accepted connection means."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return ("its CURVE hello is sealed for another key: if that is a host of this run, it holds another "
                "plan.json's (or older) keys; copy this run's plan.json and that host's artifacts/<host>/keys to it "
                "and restart its `hetero worker`")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"protocol error {value:#x} (no key, another mechanism, or not a ZeroMQ peer)"
    return "closed during the handshake (no key, another mechanism, or not a ZeroMQ peer)"


class InboxWatch(threading.Thread):
    """Logs what fails on an inbox before any message arrives: handshakes, and accepts (no descriptor left).

    Runs in its own thread, reading the inbox's ZeroMQ monitor. A refused connection is logged with the
    address ZeroMQ gives, the first ones each, then one line per LOG_EVERY_S; failed accepts once, then
    one line per LOG_EVERY_S.
    """

    def __init__(self, owner: str, thread_name: str | None = None) -> None:
        super().__init__(daemon=True, name=thread_name or f"watch-{owner}")
        self.owner = owner
        self.refused = 0
        self.accept_failures = 0
        self._refusal_logged_at = self._accept_logged_at = -math.inf
        self._done = threading.Event()
        self._monitor: zmq.Socket | None = None
        self._closed: ClosedPeers | None = None  # the inbox's port, once it listens
        self.refused_from: deque[str] = deque(maxlen=20)  # the peers of logged refusals, newest last

    def watch(self, sock: zmq.Socket) -> None:
        """Log handshakes that fail before ZAP is asked (a peer without keys, or no ZeroMQ at all) and failed accepts."""
        events = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_ACCEPT_FAILED)
        self._monitor = sock.get_monitor_socket(events)

    def listening(self, port: int) -> None:
        """The inbox is bound to ``port``: connections closing there from now on are this inbox's (called at once after
        the bind, so that connections an earlier process on the port closed are not taken for ours)."""
        self._closed = ClosedPeers(port)

    def _refuse(self, address: str | None, why: str) -> None:
        """Count a refusal; log it (the first ones, then one per LOG_EVERY_S) with its peer: ``address``, else the
        peer this inbox just hung up on (closed_peers.py), else that the address is unknown."""
        self.refused += 1
        now = time.monotonic()
        if self.refused > _LOGGED_IN_FULL and now - self._refusal_logged_at < LOG_EVERY_S:
            return
        self._refusal_logged_at = now
        if address is None:
            address = self._closed.new() if self._closed is not None else None
        if address is None:
            address = "an address neither ZeroMQ nor the kernel reports"
        else:
            self.refused_from.append(address)
        log.warning("%s refused a connection from %s: %s (%d refused so far)", self.owner, address, why, self.refused)

    def _accept_failed(self, endpoint: str, error: int) -> None:
        """libzmq could not accept a connection at ``endpoint`` (the peer is unknown: it was never accepted)."""
        self.accept_failures += 1
        now = time.monotonic()
        if now - self._accept_logged_at < LOG_EVERY_S:
            return
        self._accept_logged_at = now
        code = errno.errorcode.get(error, str(error))
        log.warning("%s cannot accept connections on %s: %s (%s), %d failed so far: every descriptor it may open is "
                    "in use (a flood of idle connections? `ss -tn` shows who holds them). Training goes on; new "
                    "connections are accepted again once ZeroMQ drops the idle ones", self.owner,
                    endpoint or "its inbox", code, os.strerror(error), self.accept_failures)

    def _on_event(self, event: Mapping[str, Any]) -> None:
        endpoint = event.get("endpoint", b"").decode("ascii", "replace")
        if event["event"] == zmq.EVENT_ACCEPT_FAILED:
            self._accept_failed(endpoint, int(event["value"]))
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # ZAP said no: already logged with the reason
        why = f"ZeroMQ handshake failed at its inbox {endpoint}: {_failure(int(event['event']), int(event['value']))}"
        # The event's endpoint is this inbox's own address: libzmq (without its draft API) reports no peer address
        # before ZAP is asked, and an accepted descriptor is reused too fast to look the peer up. Never log our own
        # address as the peer's: the kernel's closing connections name it (closed_peers.py), and the connecting
        # side logs whom it dialed (control.ConnectionWatch).
        self._refuse(None, why)

    def _drain(self) -> None:
        """Handle the monitor's queued events (up to _MONITOR_BATCH)."""
        assert self._monitor is not None
        for _ in range(_MONITOR_BATCH):
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_event(parse_monitor_message(frames))

    def _polled(self) -> list[zmq.Socket]:
        """The sockets this thread serves besides the monitor (the Gatekeeper's ZAP socket)."""
        return []

    def _serve(self, ready: dict[Any, int]) -> None:
        """Answer what is ready on the ``_polled`` sockets."""

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in [*self._polled(), self._monitor]:
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while not self._done.is_set():
                ready = dict(poller.poll(_POLL_MS))
                try:
                    if self._monitor is not None and ready.get(self._monitor):
                        self._drain()
                    self._serve(ready)
                except Exception as exc:  # this thread must outlive a bug: an unread monitor stalls libzmq
                    log.error("%s: the inbox's watch failed and goes on: %r", self.owner, exc)
        finally:
            for sock in [*self._polled(), self._monitor]:
                if sock is not None:
                    sock.close(linger=0)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)


class Gatekeeper(InboxWatch):
    """The context's ZAP handler: admits a connection only with one of the run's keys (or tokens).

    Runs in its own thread (libzmq asks it synchronously during each handshake), which also watches
    the inbox (InboxWatch); refusals are logged with the peer's address, the first ones each and then one
    line per LOG_EVERY_S.
    """

    def __init__(self, ctx: zmq.Context, owner: str, identity: Identity, peer_keys: dict[str, str]) -> None:
        super().__init__(owner, thread_name=f"zap-{owner}")
        import zmq.utils.z85 as z85

        self.mode = identity.mode
        self._by_key = {z85.decode(key.encode("ascii")): name for name, key in peer_keys.items()}
        self._verifiers = dict(identity.verifiers)  # token mode: identity -> SHA-256 of its password here
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)

    def _decide(self, mechanism: bytes, credentials: list[bytes]) -> tuple[bool, str, str]:
        if self.mode == "curve" and mechanism == b"CURVE" and len(credentials) == 1:
            name = self._by_key.get(credentials[0])
            return (True, name, "") if name else (False, "", "unknown CURVE key (not one of this plan's processes)")
        if self.mode == "token" and mechanism == b"PLAIN" and len(credentials) == 2:
            # Verifiers only: nothing this process holds logs in as another process (hetero/security.py).
            user = credentials[0].decode("utf-8", "replace")
            expected = self._verifiers.get(user)
            if expected is not None and hmac.compare_digest(expected.encode(), token_verifier(credentials[1]).encode()):
                return True, user, ""
            return False, "", f"wrong token for {user[:40]!r}"
        return False, "", f"mechanism {mechanism.decode('ascii', 'replace')[:10]} without this run's keys"

    def _polled(self) -> list[zmq.Socket]:
        return [self._sock]

    def _serve(self, ready: dict[Any, int]) -> None:
        """Answer one ZAP request, if one is waiting."""
        if not ready.get(self._sock):
            return
        request = self._sock.recv_multipart()
        if len(request) < 6:
            self._sock.send_multipart([b"1.0", request[1] if len(request) > 1 else b"", b"400",
                                       b"malformed ZAP request", b"", b""])
            return
        _version, request_id, _domain, address, _routing, mechanism, *credentials = request
        ok, user, why = self._decide(mechanism, credentials)
        if ok:
            self._sock.send_multipart([b"1.0", request_id, b"200", b"OK", user.encode(), b""])
            return
        self._refuse(address.decode("ascii", "replace"), why)
        self._sock.send_multipart([b"1.0", request_id, b"400", why.encode()[:200], b"", b""])
