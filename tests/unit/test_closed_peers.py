"""The refusing inbox names its peer from the kernel's closing connections (runtime/wire/closed_peers.py)."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from hetero.runtime.wire import closed_peers
from hetero.runtime.wire.closed_peers import ClosedPeers, _address


def test_kernel_addresses_are_read_in_kernel_byte_order() -> None:
    assert _address("0100007F:C4C0") == ("127.0.0.1", 50368)
    assert _address("0500A8C0:0050") == ("192.168.0.5", 80)
    # IPv4 peers of a dual-stack socket appear IPv4-mapped in tcp6: named as IPv4
    assert _address("0000000000000000FFFF00000100007F:1F90") == ("127.0.0.1", 8080)
    assert _address("00000000000000000000000001000000:0016") == ("::1", 22)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_a_connection_this_side_closed_is_named_and_only_once() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    watch = ClosedPeers(port)
    assert watch.new(look_for_s=0) is None  # nothing closed yet
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # this side hangs up first: the kernel keeps it (FIN_WAIT / TIME_WAIT) with the peer
    named = watch.new(look_for_s=1.0)
    assert named == f"127.0.0.1:{client.getsockname()[1]}", named
    assert watch.new(look_for_s=0) is None  # already named
    client.close()
    server.close()


def test_several_new_peers_are_all_named_never_one_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = iter([set(), {("10.0.0.5", 4000), ("10.0.0.7", 4001)}, {("10.0.0.5", 4000), ("10.0.0.7", 4001)}])
    monkeypatch.setattr(closed_peers, "closing_peers", lambda port: next(tables))
    watch = ClosedPeers(29500)
    assert watch.new(look_for_s=0) == "one of 10.0.0.5, 10.0.0.7"
    assert watch.new(look_for_s=0) is None
    monkeypatch.setattr(closed_peers, "closing_peers", lambda port: set())
    started = time.monotonic()
    assert ClosedPeers(1).new(look_for_s=0.05) is None and time.monotonic() - started < 1
