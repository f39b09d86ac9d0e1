"""`hetero profile`'s measuring side: one process per device, driven over the runtime's own Transport.

Like `hetero run`, the coordinator starts one process per device of each local host
(``python -m hetero.runtime.tools.profile_worker``; on another host, run the printed command there) and
talks to them only through ``hetero.runtime.wire.transport.Transport`` (msgpack header + raw tensor
frames, never Python-object serialization). The protocol reuses the wire's message kinds:

- worker -> coordinator ``hello`` {device, endpoint}
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

GPUs are profiled one at a time (a concurrent measurement would measure the neighbours' use of the
host's PCIe and CPU too). A host's CPU "devices" share its cores and memory bandwidth during the run,
so each is measured while the host's other CPU stages run that load: measuring each alone would
predict a faster run than the one they get, and measuring them all at once (as before) shares the
cores only while the neighbours happen to be busy, which gave non-monotonic samples and fits with
r2 0.3-0.7 on a 2-core host.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hetero.errors import HeteroError, WireError
from hetero.profile import LAYER_KINDS, DeviceProfile, LinkProfile, fit_line
from hetero.runtime.stage.device import torch_device
from hetero.security import COORDINATOR, is_loopback
from hetero.serde import from_dict, to_dict
from hetero.specs import ClusterSpec, DeviceSpec, ModelSpec

LINK_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)  # bytes per message: latency- to bandwidth-dominated
LINK_REPEATS = 5
log = logging.getLogger("hetero.profile")


def worker_name(device: str) -> str:
    return f"profile:{device}"


def _device_for(spec: DeviceSpec) -> torch.device:
    return torch_device(spec.backend, spec.index, f"`hetero profile` measures {spec.name}")


def _echo_peer(transport: Any, msg: Any, connected: set[str]) -> None:
    """Answer a link probe: send the same tensor back to its sender."""
    if msg.sender not in connected:
        transport.connect(msg.sender, str(msg.meta["reply_to"]))
        connected.add(msg.sender)
    transport.send(msg.sender, "grad", step=msg.step, mb=msg.mb, tensors={"x": msg.tensors["x"]})


def _measure_link(transport: Any, meta: dict[str, Any], connected: set[str]) -> list[list[float]]:
    """Ping-pong tensors of each size with the peer; returns [bytes, one-way seconds] medians."""
    peer = str(meta["peer"])
    if peer not in connected:
        transport.connect(peer, str(meta["endpoint"]))
        connected.add(peer)
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


def serve(name: str, coordinator: str, token: str, bind: str) -> int:
    """A profile worker: say hello, then do what the coordinator asks until ``stop``."""
    from hetero.runtime.tools.profiler import decoder_load, profile_device
    from hetero.runtime.wire.transport import Transport

    with Transport(worker_name(name), bind, token, recv_timeout_s=None) as transport:
        connected = {COORDINATOR}
        transport.connect(COORDINATOR, coordinator)
        transport.send(COORDINATOR, "hello", meta={"device": name, "endpoint": transport.endpoint})
        next_msg = None  # a message that ended a load, still to be handled
        while True:
            msg = next_msg if next_msg is not None else transport.recv(timeout_s=3600.0)
            next_msg = None
            if msg.kind == "stop":
                return 0
            if msg.kind == "act":
                _echo_peer(transport, msg, connected)
                continue
            if msg.kind != "welcome":
                continue
            op = msg.meta.get("op")
            try:
                if op in ("profile", "load"):
                    spec = from_dict(DeviceSpec, msg.meta["device"], "device")
                    model = from_dict(ModelSpec, msg.meta["model"], "model")
                    if spec.backend == "cpu":
                        torch.set_num_threads(max(1, spec.threads or 1))
                if op == "profile":

                    def progress(kind: str) -> None:
                        transport.send(COORDINATOR, "start", meta={"device": name, "layer": kind})

                    prof = profile_device(model, spec, _device_for(spec),
                                          micro_batch_size=int(msg.meta["micro_batch_size"]),
                                          share=int(msg.meta.get("share", 1)), on_layer=progress,
                                          measured_with=[str(n) for n in msg.meta.get("measured_with", [])])
                    transport.send(COORDINATOR, "state", meta={"op": "profile", "profile": to_dict(prof)})
                elif op == "load":
                    step = decoder_load(model, spec, _device_for(spec), int(msg.meta["micro_batch_size"]))
                    step()  # warm-up before saying it is loading: the measured neighbour sees a steady load
                    transport.send(COORDINATOR, "state", meta={"op": "load"})
                    next_msg = _load_until_message(transport, step)
                elif op == "link":
                    samples = _measure_link(transport, msg.meta, connected)
                    transport.send(COORDINATOR, "state", meta={"op": "link", "samples": samples})
                # op "idle" only ends a load: nothing more to do
            except Exception as exc:  # report one line; the traceback goes to this worker's log
                log.error("%s failed: %s", op, traceback.format_exc())
                line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                transport.send(COORDINATOR, "error", meta={"device": name, "message": line})


def link_from_samples(a: str, b: str, samples: list[list[float]]) -> LinkProfile:
    """Fit one-way time = latency + bytes / bandwidth over the ping-pong samples."""
    fit = fit_line([s[0] for s in samples], [s[1] for s in samples])
    latency_s = max(fit.a_s, min(s[1] for s in samples) * 0.5)  # a noisy fit may put the intercept below 0
    per_byte = fit.b_s_per_token if fit.b_s_per_token > 0 else samples[-1][1] / max(samples[-1][0], 1.0)
    return LinkProfile(a, b, 8.0 / per_byte / 1e9, latency_s * 1e6, samples)


def _spawn(device: str, coordinator: str, token: str, bind: str, log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{device}.log", "ab") as logf:
        return subprocess.Popen(
            [sys.executable, "-m", "hetero.runtime.tools.profile_worker", "--device", device, "--coordinator",
             coordinator, "--token", token, "--bind", bind],
            stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def measure_fleet(
    cluster: ClusterSpec, model: ModelSpec, micro_batch_size: int, token: str, *, log_dir: Path,
    local_hosts: set[str] | None = None, on_event: Callable[[str], None] | None = None,
    timeout_s: float = 1800.0, link_sizes: tuple[int, ...] = LINK_SIZES, link_repeats: int = LINK_REPEATS,
) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """Profile every device (one process each) and every host pair; ``on_event`` gets progress lines."""
    from hetero.runtime.run.processes import stop_processes
    from hetero.runtime.wire.transport import Transport

    say = on_event or (lambda _line: None)
    first = cluster.hosts[0]
    local = local_hosts if local_hosts is not None else {h.name for h in cluster.hosts if is_loopback(h.address)}
    with Transport(COORDINATOR, f"tcp://{first.address}:0", token, recv_timeout_s=timeout_s) as transport:
        procs = _start_workers(cluster, transport.endpoint or "", token, log_dir, local, say)
        try:
            endpoints = _gather_hellos(transport, cluster, procs, timeout_s)
            for dev in cluster.devices:
                transport.connect(worker_name(dev.name), endpoints[dev.name])
            profiles = _profile_devices(transport, cluster, model, micro_batch_size, say)
            links = []
            for a, b, sender, receiver in _link_pairs(cluster):
                transport.send(worker_name(sender), "welcome", meta={
                    "op": "link", "peer": worker_name(receiver), "endpoint": endpoints[receiver],
                    "sizes": list(link_sizes), "repeats": link_repeats})
                reply = _await_state(transport, sender, say)
                links.append(link_from_samples(a, b, reply["samples"]))
                say(f"measured link {a}<->{b}")
            return profiles, links
        finally:
            for dev in cluster.devices:
                try:
                    transport.send(worker_name(dev.name), "stop")
                except WireError:
                    pass
            stop_processes({k: p for k, p in procs.items()}, grace_s=10.0)


def _start_workers(cluster: ClusterSpec, coordinator: str, token: str, log_dir: Path, local: set[str],
                   say: Callable[[str], None]) -> dict[int, subprocess.Popen]:
    """A profile worker per device of the ``local`` hosts; for the others, the command to run there."""
    procs: dict[int, subprocess.Popen] = {}
    for i, dev in enumerate(cluster.devices):
        bind = f"tcp://{cluster.host(dev.host).address}:0"
        if dev.host in local:
            procs[i] = _spawn(dev.name, coordinator, token, bind, log_dir)
        else:
            say(f"on host {dev.host} run: python -m hetero.runtime.tools.profile_worker --device {dev.name} "
                f"--coordinator {coordinator} --token {token} --bind {bind}")
    return procs


def _profile_devices(transport: Any, cluster: ClusterSpec, model: ModelSpec, micro_batch_size: int,
                     say: Callable[[str], None]) -> list[DeviceProfile]:
    """Every device's profile, in the cluster's order; a host's CPU stages each while the others run a load."""
    by_name = {}
    for group in _profile_groups(cluster):
        for dev in group:
            # The host's other CPU stages repeat a decoder layer meanwhile: the cores are shared
            # steadily, as in the run, not by whichever neighbour happens to be measuring what.
            others = [d for d in group if d.name != dev.name]
            for other in others:
                transport.send(worker_name(other.name), "welcome", meta={
                    "op": "load", "device": to_dict(other), "model": to_dict(model),
                    "micro_batch_size": micro_batch_size})
            for other in others:
                _await_state(transport, other.name, say)
            share = sum(1 for d in cluster.devices if d.host == dev.host and d.backend == "cpu") or 1
            transport.send(worker_name(dev.name), "welcome", meta={
                "op": "profile", "device": to_dict(dev), "model": to_dict(model),
                "micro_batch_size": micro_batch_size, "share": share if dev.backend == "cpu" else 1,
                "measured_with": [d.name for d in others]})
            reply = _await_state(transport, dev.name, say)
            by_name[dev.name] = from_dict(DeviceProfile, reply["profile"], f"profile of {dev.name}")
            say(f"profiled {dev.name}")
        if len(group) > 1:  # end the last loads before anything else is measured
            for dev in group:
                transport.send(worker_name(dev.name), "welcome", meta={"op": "idle"})
    return [by_name[d.name] for d in cluster.devices]


def _profile_groups(cluster: ClusterSpec) -> list[list[DeviceSpec]]:
    """A host's CPU stages form a group (each measured while the others run a load), other devices are alone."""
    groups: list[list[DeviceSpec]] = []
    for host in cluster.hosts:
        cpus = [d for d in host.devices if d.backend == "cpu"]
        if cpus:
            groups.append(cpus)
        groups += [[d] for d in host.devices if d.backend != "cpu"]
    return groups


def _link_pairs(cluster: ClusterSpec) -> list[tuple[str, str, str, str]]:
    """(host a, host b, sending device, echoing device) for every host pair, and within hosts of 2+ devices."""
    out = []
    hosts = cluster.hosts
    for i, ha in enumerate(hosts):
        if len(ha.devices) >= 2:
            out.append((ha.name, ha.name, ha.devices[0].name, ha.devices[1].name))
        for hb in hosts[i + 1:]:
            if ha.devices and hb.devices:
                out.append((ha.name, hb.name, ha.devices[0].name, hb.devices[0].name))
    return out


def _gather_hellos(transport: Any, cluster: ClusterSpec, procs: dict[int, subprocess.Popen],
                   timeout_s: float) -> dict[str, str]:
    endpoints: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    names = {d.name for d in cluster.devices}
    while set(endpoints) != names:
        for i, p in procs.items():
            if p.poll() is not None:
                raise HeteroError(f"profile worker for {cluster.devices[i].name} exited with code {p.returncode} "
                                  "before saying hello; see its log")
        try:
            msg = transport.recv("hello", timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        except WireError:
            if time.monotonic() > deadline:
                missing = sorted(names - set(endpoints))
                raise HeteroError(f"no hello from profile worker(s) {missing} within {timeout_s:g} s") from None
            continue
        endpoints[str(msg.meta["device"])] = str(msg.meta["endpoint"])
    return endpoints


def _await_state(transport: Any, device: str, say: Callable[[str], None]) -> dict[str, Any]:
    while True:
        msg = transport.recv(sender=worker_name(device))
        if msg.kind == "error":
            raise HeteroError(f"profiling {device} failed: {msg.meta.get('message', '?')}")
        if msg.kind == "start":
            part = str(msg.meta.get("layer"))
            say(f"{device}: {part}{' layer' if part in LAYER_KINDS else ''} measured")
        elif msg.kind == "state":
            return dict(msg.meta)


def main(argv: list[str] | None = None) -> int:
    """``python -m hetero.runtime.tools.profile_worker --device NAME --coordinator tcp://.. --token T --bind tcp://..``."""
    ap = argparse.ArgumentParser(prog="hetero-profile-worker")
    ap.add_argument("--device", required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--token", required=True, help="the profile's hash; a foreign coordinator is refused")
    ap.add_argument("--bind", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return serve(args.device, args.coordinator, args.token, args.bind)
    except HeteroError as exc:
        print(f"hetero: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
