"""The control plane of a run: heartbeats, liveness and the control messages seen while waiting.

Each process sends ``heartbeat`` to the peers that watch it from a thread (so a process busy in torch
still beats), every ``heartbeat_interval(failure_timeout_s)`` seconds. A ``Mailbox`` wraps the
Transport: its blocking receives wake every SLICE_S to handle ``stop`` and ``error``, and to notice a
peer that is gone: silent for longer than its bound (hung, stopped, or its host unreachable), or
whose connection dropped and stayed down (its process exited or its host went away).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hetero.errors import HeteroError, WireError
from hetero.protocol import FAILURE_TIMEOUT_S, LOST_GRACE_S, SLICE_S, Error, Record, Stop
from hetero.runtime.wire.frames import record_of

# SLICE_S, FAILURE_TIMEOUT_S and LOST_GRACE_S are defined (and explained) in hetero/protocol.py.
log = logging.getLogger("hetero.control")


# A connecting socket whose handshake fails this many times in a row (ZeroMQ retries every 0.1 s or so) is dialing a
# process that is not its plan's: a wrong key fails every time, a lost packet not three times running.
REFUSALS_IN_A_ROW = 3


def heartbeat_interval(failure_timeout_s: float) -> float:
    """How often to beat so that several beats fit in the failure bound."""
    return max(0.1, min(1.0, failure_timeout_s / 5))


class StopRequested(Exception):
    """The coordinator asked this process to stop (normal end, Ctrl-C, or another stage failed); ``plan`` and
    ``replan``: the plan the run goes on under after a lost device (runtime.elastic), and its number."""

    def __init__(self, reason: str, plan: str | None = None, replan: int | None = None) -> None:
        super().__init__(reason)
        self.plan, self.replan = plan, replan


class PeerError(HeteroError):
    """Another process of the run reported a failure."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"{peer} failed: {message}")
        self.peer = peer
        self.message = message


class PeerLost(HeteroError):
    """A peer stopped answering: no heartbeat within its bound, or its connection dropped for good."""

    def __init__(self, peer: str, cause: str, silent: bool) -> None:
        super().__init__(f"{peer}: {cause}")
        self.peer = peer
        self.cause = cause
        self.silent = silent  # True: no heartbeat (the process may still exist); False: connection lost


def handshake_failure(event: int, value: int) -> str:
    """A ZeroMQ handshake-failure event of a connecting socket, in words."""
    import zmq

    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"its inbox refused this process's key (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"ZeroMQ protocol error {value:#x} (a wrong key, or another program)"
    reason = os.strerror(value) if 0 < value < 4096 else "no detail"
    return f"the peer closed the connection during the handshake ({reason}): it refuses this process's key"


def is_timeout(exc: WireError) -> bool:
    """Whether a transport error is a receive timeout (as opposed to a bad or foreign message)."""
    return type(exc).__name__ == "RecvTimeout" or str(exc).startswith("no ")


class ConnectionWatch:
    """Notices peers whose established connection dropped and stayed down for ``grace_s``, and peers whose
    inbox keeps failing the ZeroMQ handshake with this process.

    ZeroMQ reconnects by itself, so a drop alone is no death; one that lasts means the peer's process
    exited (the kernel closed its socket) or its host went away. A handshake that fails again and again
    (never once succeeding in between) means the process at that address is not the one this plan.json
    names: it refuses this process's key, or holds other keys itself (another plan.json, or older keys).
    The connecting side is the one that knows whom it dialed, so it is the one that says so.

    It watches the Transport's outbound sockets through ZeroMQ monitors. A watch belongs to the thread
    that uses it, and ``close()`` must run before the Transport's close (its context waits for every socket).
    """

    def __init__(self, transport: Any, peers: list[str], grace_s: float = LOST_GRACE_S) -> None:

        self.grace_s = grace_s
        self._transport = transport
        self._monitors: dict[str, Any] = {}
        self._down_since: dict[str, float] = {}
        self._refusals: dict[str, tuple[int, str, str]] = {}  # peer -> (failed handshakes in a row, endpoint, why)
        for peer in peers:
            monitor = transport.monitor(peer, self.events())
            if monitor is not None:
                self._monitors[peer] = monitor

    @staticmethod
    def events() -> int:
        """The ZeroMQ monitor events a watch reads (Transport.watch_from_start takes them too)."""
        import zmq

        return (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def _read_events(self, now: float) -> None:
        """Take the monitors' queued events into ``_down_since`` and ``_refusals``."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        failures = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        for peer, monitor in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError):
                    break
                kind = event["event"]
                # DISCONNECTED comes only from an established connection (a refused dial is
                # CONNECT_RETRIED), so a watch started after the connection came up still works.
                if kind == zmq.EVENT_CONNECTED:
                    self._down_since.pop(peer, None)
                elif kind == zmq.EVENT_DISCONNECTED:
                    self._down_since.setdefault(peer, now)
                elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._refusals.pop(peer, None)
                elif kind in failures:
                    # A refusal by the peer's ZAP handler or a protocol error is certain at once (ZeroMQ does not retry
                    # after a refusal); a connection closed mid-handshake (a wrong CURVE server key) after a few.
                    certain = kind != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    count = REFUSALS_IN_A_ROW if certain else self._refusals.get(peer, (0, "", ""))[0] + 1
                    endpoint = event.get("endpoint", b"").decode("ascii", "replace")
                    self._refusals[peer] = (count, endpoint, handshake_failure(kind, int(event["value"])))

    def lost(self) -> list[str]:
        """Peers whose connection dropped and has stayed down for ``grace_s``."""
        now = time.monotonic()
        self._read_events(now)
        return [peer for peer, since in self._down_since.items() if now - since >= self.grace_s]

    def refused(self, times: int = REFUSALS_IN_A_ROW) -> tuple[str, str, str] | None:
        """(peer, its endpoint, the last failure) of a peer whose handshake failed ``times`` times in a row, or None."""
        self._read_events(time.monotonic())
        return next(((peer, endpoint, why) for peer, (count, endpoint, why) in self._refusals.items()
                     if count >= times), None)

    def close(self) -> None:
        """Stop the monitors (a socket has one at a time: a later watch of the same peers starts its own)."""
        for peer, monitor in self._monitors.items():
            self._transport.unmonitor(peer)
            monitor.close(linger=0)
        self._monitors.clear()


class Mailbox:
    """A Transport whose blocking receives also watch the control plane.

    While waiting it notices ``stop`` (raises StopRequested, or answers a checkpoint request first),
    ``error`` from a peer (PeerError), and peers that are gone (PeerLost), so no process hangs on a
    dead run. ``last_seen`` holds the peers it watches for silence; ``bounds`` their bounds where
    they differ from ``silence_s`` (a stage that is still loading).
    """

    def __init__(self, transport: Any, watch: dict[str, float] | None = None,
                 silence_s: float = FAILURE_TIMEOUT_S, on_idle: Callable[[], None] | None = None) -> None:
        self.transport = transport
        self.last_seen = dict(watch or {})  # peer -> monotonic time it was last heard from
        self.silence_s = silence_s
        self.bounds: dict[str, float] = {}
        self.on_idle = on_idle  # called every slice (the coordinator checks its child processes)
        # A stage: called with the number of steps done when the coordinator asks for a checkpoint
        # before stopping (Ctrl-C); the coordinator's final ``stop`` follows once it has every stage's.
        self.on_checkpoint: Callable[[int], None] | None = None
        self.connections: ConnectionWatch | None = None
        self._last_poll = 0.0
        self._listening_since = 0.0

    def watch_connections(self, peers: list[str]) -> None:
        """Also report a peer whose connection drops for good (before its silence bound runs out)."""
        self.connections = ConnectionWatch(self.transport, peers)

    def close(self) -> None:
        """Release the connection monitors (before the Transport closes)."""
        if self.connections is not None:
            self.connections.close()
            self.connections = None

    def send(self, peer: str, kind: str | Record, **kwargs: Any) -> None:
        """Transport.send: a hetero.protocol record, or a kind's name with its tensors."""
        self.transport.send(peer, kind, **kwargs)

    def _take(self, kind: str) -> Any:
        try:
            return self.transport.recv(kind, timeout_s=0)
        except WireError as exc:
            if is_timeout(exc):
                return None
            raise

    def poll_control(self) -> None:
        """Handle control messages that arrived so far; raise if the run must end."""
        now = time.monotonic()
        if now - self._last_poll > 2 * SLICE_S:
            # We were busy: heartbeats may wait unread in the socket. Listen a little before judging.
            self._listening_since = now
        self._last_poll = now
        while (msg := self._take("heartbeat")) is not None:
            self.last_seen[msg.sender] = now
        if (msg := self._take("stop")) is not None:
            stop = record_of(msg, Stop)
            if stop.checkpoint is not None and self.on_checkpoint is not None:
                self.on_checkpoint(stop.checkpoint)  # then keep waiting: the state must not change until the final stop
            else:
                raise StopRequested(stop.reason or "stop requested", stop.plan, stop.replan)
        if (msg := self._take("error")) is not None:
            raise PeerError(msg.sender, record_of(msg, Error).message)
        if self.on_idle is not None:
            self.on_idle()
        if self.connections is not None and (lost := self.connections.lost()):
            raise PeerLost(lost[0], "connection lost", silent=False)
        if now - self._listening_since < 2 * SLICE_S:
            return
        for peer, seen in self.last_seen.items():
            bound = self.bounds.get(peer, self.silence_s)
            if now - seen > bound:
                raise PeerLost(peer, f"no heartbeat for {bound:g} s (hung or stopped?)", silent=True)

    def recv(self, kind: str | None = None, *, step: int | None = None, mb: int | None = None,
             sender: str | None = None, timeout_s: float | None = None, chunk: int | None = None) -> Any:
        """Like Transport.recv, but wakes up every SLICE_S to run poll_control()."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.poll_control()
            try:
                msg = self.transport.recv(kind, step=step, mb=mb, sender=sender, timeout_s=SLICE_S, chunk=chunk)
            except WireError as exc:
                if not is_timeout(exc):
                    raise
                if deadline is not None and time.monotonic() > deadline:
                    what = f"{kind!r} step {step}" + (f" mb {mb}" if mb is not None and mb >= 0 else "")
                    raise WireError(f"no {what} from {sender or 'any peer'} within {timeout_s:g} s") from None
                continue
            if msg.sender in self.last_seen:
                self.last_seen[msg.sender] = time.monotonic()
            return msg


class Heartbeat(threading.Thread):
    """Sends ``heartbeat`` to peers every ``interval_s``.

    In a stage it also ends the process (nothing is left to save: the coordinator writes every
    checkpoint) when its parent process dies or the connection to a ``watch`` peer (the coordinator)
    drops for good, even while the main thread is busy loading or computing.
    """

    def __init__(self, transport: Any, peers: list[str], parent_pid: int | None = None,
                 interval_s: float = 1.0, watch: list[str] | None = None) -> None:
        super().__init__(daemon=True, name="heartbeat")
        self.transport, self.peers, self.parent_pid = transport, peers, parent_pid
        self.interval_s = interval_s
        self.watch = list(watch or [])
        self.stopped = threading.Event()

    def run(self) -> None:
        connections = ConnectionWatch(self.transport, self.watch) if self.watch else None
        try:
            self._beat(connections)
        finally:
            if connections is not None:
                connections.close()

    def _beat(self, connections: ConnectionWatch | None) -> None:
        while not self.stopped.wait(self.interval_s):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.error("parent process %d is gone: exiting", self.parent_pid)
                os._exit(3)  # the main thread may be blocked inside torch; nothing to save
            if connections is not None and (lost := connections.lost()) and not self.stopped.is_set():
                log.error("the connection to %s is lost (its process exited or its host is unreachable): exiting",
                          lost[0])
                os._exit(3)
            if connections is not None and (refused := connections.refused()) is not None and not self.stopped.is_set():
                self._refused(*refused)
            for peer in self.peers:
                try:
                    self.transport.send(peer, "heartbeat")
                except Exception as exc:
                    if getattr(self.transport, "_closed", False):
                        return  # shutting down: nothing left to tell
                    log.warning("heartbeat to %s failed: %s", peer, exc)  # keep beating: one failure is no death

    def _refused(self, peer: str, endpoint: str, why: str) -> None:
        """A watched peer keeps failing the handshake: it is not the process this plan.json names. Say so, and exit
        (nothing reaches it, and nothing else would end this process before the coordinator's timeouts)."""
        name, plan_hash = getattr(self.transport, "name", "this process"), getattr(self.transport, "plan_hash", "?")
        line = (f"{name}: the {peer} at {endpoint} fails the handshake ({why}): it runs another plan.json or other "
                f"keys than this host's, whose plan is {plan_hash} (or another program holds that port); copy the "
                f"{peer}'s plan.json and its artifacts/<host>/keys folder to this host and restart")
        log.error("%s", line)
        print(f"hetero: error: {line}", file=sys.stderr, flush=True)
        os._exit(2)

    def finish(self) -> None:
        """Stop beating and release the connection monitors (before the Transport closes)."""
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=5)


def drop_unsent(transport: Any, linger_ms: int = 0, peers: list[str] | None = None) -> None:
    """Make close() drop, after ``linger_ms``, what ``peers`` (default: all) that already exited will never take."""
    transport.set_linger(linger_ms, peers)
