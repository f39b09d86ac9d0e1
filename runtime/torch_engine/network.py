"""The network of a torch-engine run on several hosts: addresses, the rendezvous, which interface the ranks bind.

torch.distributed neither authenticates nor encrypts (docs/security.md), so the plan's host addresses must be
private or loopback unless the user says the network is trusted; loopback only where every host is this
machine. Each host's ranks bind gloo (and NCCL) to the interface that holds that host's plan address.
Everything here runs before torch is imported (the checks of `hetero run`, one line each).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import subprocess

from hetero.errors import PlanError
from hetero.plan import Plan


def resolve(address: str) -> str:
    """A fleet file's host address (a name, IPv4 or IPv6) as this machine resolves it; one line if it cannot."""
    try:
        return str(socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise PlanError(f"cannot resolve host address '{address}' ({exc.strerror or exc}): fix it in the fleet "
                        "file") from None


def addresses(plan: Plan, trusted: bool) -> dict[str, str]:
    """Each host's plan address, resolved. Refused in one line: an address outside private and loopback ranges
    (unless ``trusted``), and a loopback address when the hosts are not all this machine (a name that resolves
    to 127.0.1.1 here, say: other hosts could not reach the rendezvous)."""
    from hetero.runtime.torch_engine.rank import node_hosts

    out = {name: resolve(plan.cluster.host(name).address) for name in node_hosts(plan)}
    loopback = {name for name, a in out.items() if ipaddress.ip_address(a).is_loopback}
    for name, address in out.items():
        ip = ipaddress.ip_address(address)
        if not (ip.is_private or ip.is_loopback) and not trusted:
            raise PlanError(f"--engine torch: host '{name}' is at {address}, outside private and loopback ranges, and "
                            "torch.distributed neither authenticates nor encrypts (docs/security.md): use --engine "
                            "hetero, or pass --trusted-network if this network is yours alone")
    for name, address in out.items():
        if name in loopback and len(loopback) < len(out):
            raise PlanError(f"--engine torch: host '{name}' address '{plan.cluster.host(name).address}' is {address} "
                            "(loopback) here, which other hosts cannot reach: give it its LAN address in the fleet file")
    return out


def rendezvous(plan: Plan, port: int | None, address: str | None = None) -> str:
    """ADDRESS:PORT of a multi-host run's rendezvous: stage 0's host, at ``port`` or its coordinator port."""
    host = plan.cluster.host(plan.stages[0].host)
    address = address or resolve(host.address)
    shown = f"[{address}]" if ":" in address else address
    return f"{shown}:{port if port is not None else host.port - 1}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    address, port = endpoint.rsplit(":", 1)
    return address.strip("[]"), int(port)


def check_hosts(plan: Plan, port: int | None, trusted: bool) -> None:
    """A multi-host run's network checks, before anything starts: the addresses, and the rendezvous port free
    on every interface of this host (torch's store binds them all)."""
    from hetero.runtime.torch_engine.rank import node_hosts

    if len(node_hosts(plan)) == 1:
        return  # one host: the rendezvous takes a free port of 127.0.0.1
    addresses(plan, trusted)
    endpoint = rendezvous(plan, port)
    address, number = split_endpoint(endpoint)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds it
        try:
            s.bind(("", number))
        except OSError as exc:
            raise PlanError(f"--engine torch: the rendezvous port {number} on host {plan.stages[0].host} is not free "
                            f"({exc.strerror or exc}): pass another with --port") from None


def _interfaces_from_ip() -> dict[str, str] | None:
    """{address: interface} of every address (IPv4 and IPv6, secondary ones too) `ip -o addr` lists; None
    without iproute2."""
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and words[2] in ("inet", "inet6"):
            found[words[3].split("/")[0]] = words[1].split("@")[0]
    return found


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address``, or None."""
    listed = _interfaces_from_ip()
    if listed is not None:
        return listed.get(address)
    siocgifaddr = 0x8915  # without iproute2: each interface's primary IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def bind_collectives(backend: str, host: str, address: str) -> None:
    """Make this host's ranks (which inherit the environment) bind their collectives to ``address``'s interface."""
    name = interface_of(address)
    if name is None:
        raise PlanError(f"host '{host}' has address {address} in the plan, but no network interface of this machine "
                        "has it: run this host's part where that address is, or fix the fleet file")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    if backend == "nccl":
        os.environ["NCCL_SOCKET_IFNAME"] = name


def answers(endpoint: str, timeout_s: float) -> OSError | None:
    """None when ``endpoint`` accepts a TCP connection within ``timeout_s`` (closed at once, unopened: torch's
    store takes that without a word), else why not."""
    try:
        socket.create_connection(split_endpoint(endpoint), timeout=timeout_s).close()
        return None
    except OSError as exc:
        return exc
