"""Endpoints: ``tcp://HOST:PORT`` parsed, joined (IPv6 bracketed, localhost pinned to IPv4) and resolved to the
address an inbox binds (exactly the plan's, never every interface)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from hetero.errors import WireError


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
            host = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
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


def _join(host: str, port: str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed and localhost pinned to IPv4."""
    if host == "localhost":
        host = "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The ports this machine hands to outgoing connections (first, last), or None where it does not say (not Linux).

    A port in that range can be handed to a socket that dials it before anything listens there: on one machine the
    dialer then connects to itself (TCP's simultaneous open), holds the port, and the stage cannot bind it."""
    try:
        with open(path) as f:
            first, last = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return first, last


def endpoint_port(endpoint: str) -> int | None:
    """The port of ``tcp://HOST:PORT`` (None for ``*``)."""
    port = _parse_tcp_endpoint(endpoint)[1]
    return int(port) if port.isdigit() else None


def ports_in(ports: list[int], span: tuple[int, int] | None) -> list[int]:
    """The ``ports`` that lie in ``span`` (inclusive), sorted, each once."""
    return [] if span is None else sorted({p for p in ports if span[0] <= p <= span[1]})
