"""`hetero profile`'s measuring side: one process per device, driven over the runtime's own Transport.

Like `hetero run`, the coordinator (runtime/tools/profile_fleet.py) starts one process per device of its own
host (``python -m hetero.runtime.tools.profile_worker --session SESSION.json --device NAME``; on another host,
run the printed command there) and talks to them only through ``hetero.runtime.wire.transport.Transport``
(msgpack header + raw tensor frames, never Python-object serialization). Who may talk is the run's key
machinery (hetero/security.py), with keys made afresh for each profile: session.json holds the fleet, the
coordinator's endpoint and every identity's public key (or token verifiers); each host's key files hold its
own processes' secrets. A process without a key of the session cannot drive a worker, answer for one, or
read their traffic (CurveZMQ off loopback). A worker connects only to the coordinator the session names and to
other workers at their own host's address, and it ends when the coordinator does: its parent process gone
(a worker this host started) or the coordinator's connection down for good.

The protocol reuses the wire's message kinds:

- worker -> coordinator ``hello`` {device, endpoint}; ``heartbeat`` every second from a thread
- coordinator -> worker ``welcome`` {op: "profile", model, device, micro_batch_size, share, measured_with}
  -> worker runs ``profiler.profile_device`` (its own thread count) and answers ``state`` {op: "profile", profile}
  (``start`` {layer} after each layer kind, the optimizer and the messages: the progress bar)
- coordinator -> worker ``welcome`` {op: "link", peer, endpoint, sizes, repeats}: the worker sends
  ``act`` tensors of each size to the peer, which echoes each as ``grad``; one-way time is half
  the round trip; answers ``state`` {op: "link", samples}
- coordinator -> worker ``welcome`` {op: "load", model, device, micro_batch_size}: the worker
  answers ``state`` {op: "load"} and repeats a decoder layer's forward+backward until its next message
  (``welcome`` {op: "idle"} just ends it)
- ``stop`` ends a worker; a failure is reported as ``error`` {message}.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetero.errors import HeteroError, WireError
from hetero.security import COORDINATOR, SecuritySpec
from hetero.serde import from_dict, to_dict
from hetero.specs import ClusterSpec, DeviceSpec, ModelSpec

SESSION_FILE = "session.json"
log = logging.getLogger("hetero.profile")


def worker_name(device: str) -> str:
    return f"profile:{device}"


@dataclass(frozen=True)
class ProfileSession:
    """A profile's session.json: what a worker needs besides its own key file (nothing in it is secret)."""

    token: str  # the profile's hash (fleet + model), carried by every message
    coordinator: str  # the coordinator's endpoint
    cluster: ClusterSpec
    security: SecuritySpec

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(to_dict(self), indent=1))

    @staticmethod
    def load(path: Path) -> ProfileSession:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise HeteroError(f"cannot read the profile session {path} ({exc}): copy the session folder that "
                              "`hetero profile` printed to this host") from None
        return from_dict(ProfileSession, data, str(path), error=HeteroError)

    def worker_hosts(self) -> dict[str, str]:
        """Each worker's identity -> its host."""
        return {worker_name(d.name): d.host for d in self.cluster.devices}

    def device(self, name: str) -> DeviceSpec:
        try:
            return self.cluster.device(name)
        except KeyError:
            raise HeteroError(f"device {name!r} is not in the profiled fleet; its devices: "
                              f"{', '.join(d.name for d in self.cluster.devices)}") from None


def checked_endpoint(endpoint: Any, address: str, whose: str) -> str:
    """``endpoint`` if it is a concrete port at ``address`` (the fleet file's address of ``whose`` host), else a
    HeteroError: a profile process dials only the processes of its own fleet, where the fleet says they are."""
    from hetero.runtime.wire.endpoints import _parse_tcp_endpoint

    try:
        host, port = _parse_tcp_endpoint(str(endpoint))
    except WireError:
        host, port = "", ""
    if host != address.strip("[]") or not port.isdigit() or int(port) == 0:
        raise HeteroError(f"refused to connect to {str(endpoint)[:100]!r} for {whose}: not a port at its host's "
                          f"address {address} in the fleet file")
    return str(endpoint)


def _device_for(spec: DeviceSpec) -> torch.device:
    from hetero.runtime.stage.device import torch_device

    return torch_device(spec.backend, spec.index, f"`hetero profile` measures {spec.name}")


class Peers:
    """The workers this worker may talk to besides the coordinator: connected on first use, at their host's address."""

    def __init__(self, transport: Any, session: ProfileSession) -> None:
        self.transport, self.session = transport, session
        self.addresses = {worker_name(d.name): session.cluster.host(d.host).address for d in session.cluster.devices}
        self.connected = {COORDINATOR}

    def connect(self, peer: str, endpoint: Any) -> str:
        if peer not in self.addresses:
            raise HeteroError(f"refused to talk to {peer[:100]!r}: not a device of the profiled fleet")
        if peer not in self.connected:
            self.transport.connect(peer, checked_endpoint(endpoint, self.addresses[peer], peer))
            self.connected.add(peer)
        return peer


def _echo_peer(peers: Peers, msg: Any) -> None:
    """Answer a link probe: send the same tensor back to its (authenticated) sender."""
    peers.connect(msg.sender, msg.meta.get("reply_to"))
    peers.transport.send(msg.sender, "grad", step=msg.step, mb=msg.mb, tensors={"x": msg.tensors["x"]})


def _measure_link(peers: Peers, meta: dict[str, Any]) -> list[list[float]]:
    """Ping-pong tensors of each size with the peer; returns [bytes, one-way seconds] medians."""
    transport = peers.transport
    peer = peers.connect(str(meta["peer"]), meta["endpoint"])
    samples = []
    seq = 0
    for size in meta["sizes"]:
        x = torch.zeros(int(size) // 4, dtype=torch.float32)
        trips = []
        for rep in range(int(meta["repeats"]) + 1):  # the first trip warms the connection up
            seq += 1
            t0 = time.perf_counter()
            transport.send(peer, "act", step=seq, mb=0, tensors={"x": x}, meta={"reply_to": transport.endpoint})
            transport.recv("grad", step=seq, sender=peer, timeout_s=60.0)
            if rep:
                trips.append(time.perf_counter() - t0)
        samples.append([float(x.numel() * 4), statistics.median(trips) / 2])
    return samples


LOAD_SLICE_S = 0.05  # run the load this long between looks for the coordinator's next message


def _load_until_message(transport: Any, step: Callable[[], None]) -> Any:
    """Repeat ``step`` (a stage's work) until a message arrives, and return that message."""
    while True:
        deadline = time.perf_counter() + LOAD_SLICE_S
        step()  # at least one step between looks, however short the slice
        while time.perf_counter() < deadline:
            step()
        try:
            return transport.recv(timeout_s=0.001)
        except WireError:  # nothing yet (or a malformed message, already discarded): keep loading
            continue


def _do(op: Any, msg: Any, name: str, peers: Peers) -> Any:
    """Carry out one ``welcome``; returns the message that ended a load (to handle next), else None."""
    from hetero.runtime.tools.profiler import decoder_load, profile_device

    transport = peers.transport
    if op in ("profile", "load"):
        spec = from_dict(DeviceSpec, msg.meta["device"], "device")
        model = from_dict(ModelSpec, msg.meta["model"], "model")
        if spec.backend == "cpu":
            torch.set_num_threads(max(1, spec.threads or 1))
    if op == "profile":

        def progress(kind: str) -> None:
            transport.send(COORDINATOR, "start", meta={"device": name, "layer": kind})

        prof = profile_device(model, spec, _device_for(spec), micro_batch_size=int(msg.meta["micro_batch_size"]),
                              share=int(msg.meta.get("share", 1)), on_layer=progress,
                              measured_with=[str(n) for n in msg.meta.get("measured_with", [])])
        transport.send(COORDINATOR, "state", meta={"op": "profile", "profile": to_dict(prof)})
    elif op == "load":
        step = decoder_load(model, spec, _device_for(spec), int(msg.meta["micro_batch_size"]))
        step()  # warm-up before saying it is loading: the measured neighbour sees a steady load
        transport.send(COORDINATOR, "state", meta={"op": "load"})
        return _load_until_message(transport, step)
    elif op == "link":
        transport.send(COORDINATOR, "state", meta={"op": "link", "samples": _measure_link(peers, msg.meta)})
    return None  # op "idle" only ends a load: nothing more to do


def _serve_loop(peers: Peers, name: str) -> int:
    """Do what the coordinator asks until ``stop``; answer other workers' link probes."""
    transport = peers.transport
    next_msg = None  # a message that ended a load, still to be handled
    while True:
        msg = next_msg if next_msg is not None else transport.recv(timeout_s=None)
        next_msg = None
        if msg.kind == "stop" and msg.sender == COORDINATOR:
            return 0
        if msg.kind == "act" and msg.sender != COORDINATOR:
            try:
                _echo_peer(peers, msg)
            except HeteroError as exc:
                log.error("%s", exc)
            continue
        if msg.kind != "welcome" or msg.sender != COORDINATOR:
            continue
        op = msg.meta.get("op")
        try:
            next_msg = _do(op, msg, name, peers)
        except Exception as exc:  # report one line; the traceback goes to this worker's log
            log.error("%s failed: %s", op, traceback.format_exc())
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            transport.send(COORDINATOR, "error", meta={"device": name, "message": line})


def serve(session: ProfileSession, device: str, keys: list[Path], parent_pid: int | None = None) -> int:
    """A profile worker: say hello, then do what the coordinator asks until ``stop``."""
    # The measuring code (torch, transformers, peft) is imported before hello: once the coordinator watches this
    # worker's heartbeats, a long import must not look like a dead worker.
    from hetero.runtime.tools import profiler  # noqa: F401
    from hetero.runtime.wire.control import ConnectionWatch, Heartbeat
    from hetero.runtime.wire.transport import Transport
    from hetero.security import load_identity

    spec = session.device(device)
    first = session.cluster.hosts[0]
    coordinator = checked_endpoint(session.coordinator, first.address, f"the coordinator (host {first.name})")
    identity = load_identity(session.security, worker_name(device), keys)
    bind = f"tcp://{session.cluster.host(spec.host).address}:0"
    with Transport(worker_name(device), bind, session.token, recv_timeout_s=None, identity=identity,
                   peer_keys=session.security.public_keys) as transport:
        log.info("%s listening on %s (security %s)", worker_name(device), transport.endpoint, session.security.mode)
        transport.watch_from_start(ConnectionWatch.events())  # a coordinator that refuses our key is said at once
        transport.connect(COORDINATOR, coordinator)
        # Ends this process when the profile's process is gone (parent_pid) or its connection drops for good,
        # even while the main thread is busy measuring.
        heartbeat = Heartbeat(transport, [COORDINATOR], parent_pid, watch=[COORDINATOR])
        heartbeat.start()
        try:
            transport.send(COORDINATOR, "hello", meta={"device": device, "endpoint": transport.endpoint})
            return _serve_loop(Peers(transport, session), device)
        finally:
            heartbeat.finish()


def main(argv: list[str] | None = None) -> int:
    """``python -m hetero.runtime.tools.profile_worker --session DIR/session.json --device NAME [--keys DIR]``."""
    ap = argparse.ArgumentParser(prog="hetero-profile-worker")
    ap.add_argument("--session", required=True, type=Path, help="the session.json `hetero profile` wrote")
    ap.add_argument("--device", required=True)
    ap.add_argument("--keys", type=Path, default=None,
                    help="the folder of this host's key files (default: artifacts/<host>/keys beside session.json)")
    ap.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        session = ProfileSession.load(args.session)
        host = session.device(args.device).host
        keys = [args.keys] if args.keys is not None else [args.session.resolve().parent / "artifacts" / host / "keys"]
        return serve(session, args.device, keys, args.parent_pid)
    except HeteroError as exc:
        print(f"hetero: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
