"""Who an inbox just hung up on: the peer address libzmq does not report for a handshake that fails before ZAP.

libzmq 4.3 (without its draft API) reports a failed handshake on an accepted connection with the inbox's own
address only, and by the time the event is read the descriptor is closed (and may be reused). The kernel
still knows: the side that closes a TCP connection keeps it for a while (FIN_WAIT, then TIME_WAIT for
about 60 s on Linux) with both addresses. So the peers of connections to the inbox's port that are closing
now and were not closing at the previous look are the peers this inbox just refused. Linux only (it reads
/proc/net/tcp and tcp6); elsewhere, and when nothing new is found, the address stays unknown and is logged
as such. Several new peers (two refusals between looks) are all named: never one guessed among them.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

# TCP states of a connection this side closed first (include/net/tcp_states.h): FIN_WAIT1, FIN_WAIT2,
# TIME_WAIT, CLOSING.
_CLOSED_BY_US = {"04", "05", "06", "0B"}
_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
LOOK_FOR_S = 0.05  # libzmq closes the descriptor right after it reports the failure: look again this long
_MAX_NAMED = 3


def _address(hex_address: str) -> tuple[str, int]:
    """``0100007F:C4C0`` (kernel byte order, 32-bit words) as ("127.0.0.1", 50368); IPv4-mapped IPv6 as IPv4."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    packed = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    if len(packed) == 16 and packed[:12] == b"\0" * 10 + b"\xff\xff":
        packed = packed[12:]
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, packed), int(port, 16)


def closing_peers(port: int) -> set[tuple[str, int]]:
    """(address, port) of every connection to local ``port`` that this host closed and still holds."""
    found: set[tuple[str, int]] = set()
    for table in _TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] not in _CLOSED_BY_US:
                continue
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.add(_address(fields[2]))
            except (ValueError, IndexError, OSError):
                continue
    return found


class ClosedPeers:
    """The peers of one port's connections closed since the last look (see the module docstring)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._seen = closing_peers(port)

    def new(self, look_for_s: float = LOOK_FOR_S) -> str | None:
        """The peer address(es) of connections closed since the last call, in words; None if none is found."""
        deadline = time.monotonic() + look_for_s
        while True:
            now = closing_peers(self.port)
            fresh = now - self._seen
            if fresh or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        self._seen = now
        if not fresh:
            return None
        hosts = sorted({host for host, _ in fresh})
        if len(fresh) == 1:
            host, port = next(iter(fresh))
            return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        named = ", ".join(hosts[:_MAX_NAMED]) + (f" and {len(hosts) - _MAX_NAMED} more" if len(hosts) > _MAX_NAMED else "")
        return named if len(hosts) == 1 else f"one of {named}"
