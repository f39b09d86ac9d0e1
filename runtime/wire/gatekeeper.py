"""The ZAP handler of a process's inbox: admits a connection only with one of the run's keys (or tokens).

ZeroMQ asks the context's ZAP handler (RFC 27) during each handshake on a CURVE or PLAIN server
socket; a peer that is not one of the run's processes is refused there, before any of its bytes
reach the Transport, and the refusal is logged with its address.
"""

from __future__ import annotations

import hmac
import logging
import threading

import zmq

from hetero.security import Identity

log = logging.getLogger("hetero.runtime.wire.transport")  # refusals log beside the transport's drops
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)


class Gatekeeper(threading.Thread):
    """The context's ZAP handler: admits a connection only with one of the run's keys (or tokens).

    Runs in its own thread (libzmq asks it synchronously during each handshake); every refusal is
    logged with the peer's address, the first ones in full and then one line per 100.
    """

    def __init__(self, ctx: zmq.Context, owner: str, identity: Identity, peer_keys: dict[str, str]) -> None:
        super().__init__(daemon=True, name=f"zap-{owner}")
        import zmq.utils.z85 as z85

        self.owner = owner
        self.mode = identity.mode
        self._by_key = {z85.decode(key.encode("ascii")): name for name, key in peer_keys.items()}
        self._tokens = dict(identity.peer_tokens)
        self.refused = 0
        self._done = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._monitor: zmq.Socket | None = None

    def watch(self, sock: zmq.Socket) -> None:
        """Also log handshakes that fail before ZAP is asked (a peer without keys, or no ZeroMQ at all)."""
        events = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._monitor = sock.get_monitor_socket(events)

    def _refuse(self, address: str, why: str) -> None:
        self.refused += 1
        if self.refused <= 10 or self.refused % 100 == 0:
            log.warning("%s refused a connection from %s: %s (%d refused so far)", self.owner, address or "?", why,
                        self.refused)

    def _decide(self, mechanism: bytes, credentials: list[bytes]) -> tuple[bool, str, str]:
        if self.mode == "curve" and mechanism == b"CURVE" and len(credentials) == 1:
            name = self._by_key.get(credentials[0])
            return (True, name, "") if name else (False, "", "unknown CURVE key (not one of this plan's processes)")
        if self.mode == "token" and mechanism == b"PLAIN" and len(credentials) == 2:
            user = credentials[0].decode("utf-8", "replace")
            token = self._tokens.get(user)
            if token is not None and hmac.compare_digest(token.encode(), credentials[1]):
                return True, user, ""
            return False, "", f"wrong token for {user[:40]!r}"
        return False, "", f"mechanism {mechanism.decode('ascii', 'replace')[:10]} without this run's keys"

    def _on_event(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(self._monitor)  # type: ignore[arg-type]
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # ZAP said no: already logged with the reason
        why = "ZeroMQ handshake failed (no key, another mechanism, or not a ZeroMQ peer)"
        self._refuse(event.get("endpoint", b"").decode("ascii", "replace"), why)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._done.is_set():
                ready = dict(poller.poll(200))
                if self._monitor is not None and ready.get(self._monitor):
                    self._on_event()
                if not ready.get(self._sock):
                    continue
                request = self._sock.recv_multipart()
                if len(request) < 6:
                    self._sock.send_multipart([b"1.0", request[1] if len(request) > 1 else b"", b"400",
                                               b"malformed ZAP request", b"", b""])
                    continue
                _version, request_id, _domain, address, _routing, mechanism, *credentials = request
                ok, user, why = self._decide(mechanism, credentials)
                if ok:
                    self._sock.send_multipart([b"1.0", request_id, b"200", b"OK", user.encode(), b""])
                    continue
                self._refuse(address.decode("ascii", "replace"), why)
                self._sock.send_multipart([b"1.0", request_id, b"400", why.encode()[:200], b"", b""])
        finally:
            self._sock.close(linger=0)
            if self._monitor is not None:
                self._monitor.close(linger=0)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)
