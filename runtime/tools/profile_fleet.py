"""`hetero profile`'s coordinator: keys for the session, a worker per device, then every device and link measured.

Each profile makes its own keys (hetero/security.py's machinery, the mode `hetero compile` would choose:
CurveZMQ off loopback, per-process tokens on one machine): ``SESSION_DIR/session.json`` (public) and
``SESSION_DIR/artifacts/<host>/keys/`` (each host's secrets). This host's workers are started here; for
another host the coordinator prints the command to run there, after copying the session folder. The
coordinator hears each worker's heartbeat, so a worker that dies or hangs ends the profile in seconds
with its name, and its workers end when it does (runtime/tools/profile_worker.py).

GPUs are profiled one at a time (a concurrent measurement would measure the neighbours' use of the
host's PCIe and CPU too). A host's CPU "devices" share its cores and memory bandwidth during the run,
so each is measured while the host's other CPU stages run that load: measuring each alone would
predict a faster run than the one they get, and measuring them all at once (as before) shares the
cores only while the neighbours happen to be busy, which gave non-monotonic samples and fits with
r2 0.3-0.7 on a 2-core host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError, WireError
from hetero.profile import LAYER_KINDS, DeviceProfile, LinkProfile, fit_line
from hetero.runtime.base.processes import module_argv
from hetero.runtime.tools.profile_worker import SESSION_FILE, ProfileSession, checked_endpoint, worker_name
from hetero.security import COORDINATOR, Mode, is_loopback
from hetero.serde import from_dict, to_dict
from hetero.specs import ClusterSpec, DeviceSpec, ModelSpec

LINK_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)  # bytes per message: latency- to bandwidth-dominated
LINK_REPEATS = 5
# A worker's heartbeats come from a thread, so a busy worker still beats; one silent this long is hung or gone.
WORKER_SILENCE_S = 30.0


def link_from_samples(a: str, b: str, samples: list[list[float]], mode: str = "none") -> LinkProfile:
    """Fit one-way time = latency + bytes / bandwidth over the ping-pong samples, taken under security ``mode`` (under
    curve the fit includes the cipher's work, which the plan's links then need not add)."""
    fit = fit_line([s[0] for s in samples], [s[1] for s in samples])
    latency_s = max(fit.a_s, min(s[1] for s in samples) * 0.5)  # a noisy fit may put the intercept below 0
    per_byte = fit.b_s_per_token if fit.b_s_per_token > 0 else samples[-1][1] / max(samples[-1][0], 1.0)
    return LinkProfile(a, b, 8.0 / per_byte / 1e9, latency_s * 1e6, samples, method=f"zmq ping-pong, security {mode}")


def _spawn(device: str, session: Path, log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{device}.log", "ab") as logf:
        return subprocess.Popen(
            [*module_argv("hetero.runtime.tools.profile_worker"), "--session", str(session), "--device",
             device, "--parent-pid", str(os.getpid())],
            stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def start_session(cluster: ClusterSpec, token: str, mode: Mode, session_dir: Path) -> tuple[Any, ProfileSession]:
    """Fresh keys for the coordinator and every device's worker, the coordinator's inbox, and session.json."""
    from hetero.runtime.wire.transport import Transport
    from hetero.security import generate_for, load_identity

    first = cluster.hosts[0]
    session_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(session_dir, 0o700)
    hosts = {COORDINATOR: first.name, **{worker_name(d.name): d.host for d in cluster.devices}}
    security = generate_for(mode, hosts, session_dir)
    identity = load_identity(security, COORDINATOR, [session_dir / "artifacts" / first.name / "keys"])
    transport = Transport(COORDINATOR, f"tcp://{first.address}:0", token, identity=identity,
                          peer_keys=security.public_keys)
    session = ProfileSession(token, transport.endpoint or "", cluster, security)
    session.save(session_dir / SESSION_FILE)
    return transport, session


def measure_fleet(
    cluster: ClusterSpec, model: ModelSpec, micro_batch_size: int, token: str, *, log_dir: Path, session_dir: Path,
    security: Mode = "token", local_hosts: set[str] | None = None, on_event: Callable[[str], None] | None = None,
    timeout_s: float = 1800.0, link_sizes: tuple[int, ...] = LINK_SIZES, link_repeats: int = LINK_REPEATS,
) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """Profile every device (one process each) and every host pair; ``on_event`` gets progress lines.

    ``local_hosts``: the hosts whose workers are started here (default: the first host, where the coordinator
    listens, and every loopback host)."""
    from hetero.runtime.base.processes import stop_processes
    from hetero.runtime.wire.control import Mailbox

    say = on_event or (lambda _line: None)
    local = local_hosts if local_hosts is not None else (
        {cluster.hosts[0].name} | {h.name for h in cluster.hosts if is_loopback(h.address)})
    transport, session = start_session(cluster, token, security, session_dir)
    procs: dict[int, subprocess.Popen] = {}
    mailbox = None
    try:
        procs = _start_workers(cluster, session_dir, log_dir, local, say)
        endpoints = _gather_hellos(transport, cluster, procs, timeout_s, log_dir)
        for dev in cluster.devices:
            transport.connect(worker_name(dev.name), endpoints[dev.name])
        now = time.monotonic()
        mailbox = Mailbox(transport, watch={worker_name(d.name): now for d in cluster.devices},
                          silence_s=WORKER_SILENCE_S, on_idle=lambda: _check_workers(cluster, procs, log_dir))
        mailbox.watch_connections([worker_name(d.name) for d in cluster.devices])
        profiles = _profile_devices(mailbox, cluster, model, micro_batch_size, say, timeout_s, log_dir)
        links = []
        for a, b, sender, receiver in _link_pairs(cluster):
            transport.send(worker_name(sender), "welcome", meta={
                "op": "link", "peer": worker_name(receiver), "endpoint": endpoints[receiver],
                "sizes": list(link_sizes), "repeats": link_repeats})
            reply = _await_state(mailbox, sender, say, timeout_s, log_dir)
            links.append(link_from_samples(a, b, reply["samples"], security))
            say(f"measured link {a}<->{b}")
        return profiles, links
    finally:
        for dev in cluster.devices:
            try:
                transport.send(worker_name(dev.name), "stop")
            except WireError:
                pass
        stop_processes(dict(procs), grace_s=10.0)
        if mailbox is not None:
            mailbox.close()
        transport.close()
        # The keys were for this profile only; the next one makes its own.
        shutil.rmtree(session_dir / "artifacts", ignore_errors=True)


def _check_workers(cluster: ClusterSpec, procs: dict[int, subprocess.Popen], log_dir: Path) -> None:
    for i, p in procs.items():
        if p.poll() is not None:
            name = cluster.devices[i].name
            raise HeteroError(f"profile worker for {name} exited with code {p.returncode}; see {log_dir / name}.log")


def _start_workers(cluster: ClusterSpec, session_dir: Path, log_dir: Path, local: set[str],
                   say: Callable[[str], None]) -> dict[int, subprocess.Popen]:
    """A profile worker per device of the ``local`` hosts; for the others, the command to run there."""
    procs: dict[int, subprocess.Popen] = {}
    session = session_dir / SESSION_FILE
    for i, dev in enumerate(cluster.devices):
        if dev.host in local:
            procs[i] = _spawn(dev.name, session, log_dir)
        else:
            say(f"on host {dev.host} run (after copying {session_dir}/{SESSION_FILE} and {session_dir}/artifacts/"
                f"{dev.host} there): hetero profile-worker --session {session} "
                f"--device {dev.name}")
    return procs


def _profile_devices(mailbox: Any, cluster: ClusterSpec, model: ModelSpec, micro_batch_size: int,
                     say: Callable[[str], None], timeout_s: float, log_dir: Path) -> list[DeviceProfile]:
    """Every device's profile, in the cluster's order; a host's CPU stages each while the others run a load."""
    by_name = {}
    for group in _profile_groups(cluster):
        for dev in group:
            # The host's other CPU stages repeat a decoder layer meanwhile: the cores are shared
            # steadily, as in the run, not by whichever neighbour happens to be measuring what.
            others = [d for d in group if d.name != dev.name]
            for other in others:
                mailbox.send(worker_name(other.name), "welcome", meta={
                    "op": "load", "device": to_dict(other), "model": to_dict(model),
                    "micro_batch_size": micro_batch_size})
            for other in others:
                _await_state(mailbox, other.name, say, timeout_s, log_dir)
            share = sum(1 for d in cluster.devices if d.host == dev.host and d.backend == "cpu") or 1
            mailbox.send(worker_name(dev.name), "welcome", meta={
                "op": "profile", "device": to_dict(dev), "model": to_dict(model),
                "micro_batch_size": micro_batch_size, "share": share if dev.backend == "cpu" else 1,
                "measured_with": [d.name for d in others]})
            reply = _await_state(mailbox, dev.name, say, timeout_s, log_dir)
            by_name[dev.name] = from_dict(DeviceProfile, reply["profile"], f"profile of {dev.name}")
            say(f"profiled {dev.name}")
        if len(group) > 1:  # end the last loads before anything else is measured
            for dev in group:
                mailbox.send(worker_name(dev.name), "welcome", meta={"op": "idle"})
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
                   timeout_s: float, log_dir: Path) -> dict[str, str]:
    """Each device's worker endpoint, from its (authenticated) hello; only at its host's address in the fleet."""
    endpoints: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    devices = {d.name: d for d in cluster.devices}
    while set(endpoints) != set(devices):
        for i, p in procs.items():
            if p.poll() is not None:
                name = cluster.devices[i].name
                raise HeteroError(f"profile worker for {name} exited with code {p.returncode} before saying hello; "
                                  f"see {log_dir / name}.log")
        try:
            msg = transport.recv("hello", timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        except WireError:
            if time.monotonic() > deadline:
                missing = sorted(set(devices) - set(endpoints))
                raise HeteroError(f"no hello from profile worker(s) {missing} within {timeout_s:g} s") from None
            continue
        device = devices.get(str(msg.meta.get("device")))
        if device is None or msg.sender != worker_name(device.name):
            continue  # a worker speaks for its own device only
        address = cluster.host(device.host).address
        endpoints[device.name] = checked_endpoint(msg.meta.get("endpoint"), address, msg.sender)
    return endpoints


def _await_state(mailbox: Any, device: str, say: Callable[[str], None], timeout_s: float,
                 log_dir: Path) -> dict[str, Any]:
    """The worker's next ``state``; its progress lines meanwhile. A failed, dead or silent worker: one line."""
    from hetero.runtime.wire.control import PeerError, PeerLost

    while True:
        try:
            msg = mailbox.recv(sender=worker_name(device), timeout_s=timeout_s)
        except PeerError as exc:
            raise HeteroError(f"profiling {exc.peer.removeprefix('profile:')} failed: {exc.message}") from None
        except PeerLost as exc:
            name = exc.peer.removeprefix("profile:")
            raise HeteroError(f"profile worker for {name}: {exc.cause}; see {log_dir / name}.log (a worker started "
                              "by hand on another host: its output there)") from None
        except WireError as exc:
            raise HeteroError(f"profiling {device}: {exc}") from None
        if msg.kind == "start":
            part = str(msg.meta.get("layer"))
            say(f"{device}: {part}{' layer' if part in LAYER_KINDS else ''} measured")
        elif msg.kind == "state":
            return dict(msg.meta)
