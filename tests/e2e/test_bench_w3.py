"""bench/w3_net.py, W3's link: namespaces, veth and tbf come up, and nothing is left behind (root only, ~1 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (ip netns, tc)")


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_root
def test_link_pair_comes_up_and_leaves_nothing_behind() -> None:
    import w3_net

    if (refused := w3_net.netns_refused()) is not None:
        pytest.skip(f"ip netns refused: {refused}")

    link = w3_net.LinkPair()
    try:
        link.up()
        assert "100 Mbit/s" in link.set_rate(w3_net.parse_rate("100mbit"))
        qdisc = subprocess.run(["tc", "-n", link.ns[1], "qdisc", "show", "dev", link.veth[1]], capture_output=True,
                               text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        before = link.tx_bytes()
        # The namespaces reach each other over the veth (a TCP connect both ways moves counted bytes).
        for src in (0, 1):
            dst_ip = w3_net.IPS[1 - src]
            probe_cmd = [sys.executable, "-c", "import socket, sys; socket.create_connection((sys.argv[1], 9), 2)",
                         dst_ip]
            subprocess.run(link.exec(src, probe_cmd), capture_output=True, timeout=30)  # refused: still a SYN/RST
        after = link.tx_bytes()
        assert after[0] > before[0] and after[1] > before[1]
        # A process left running inside is ended by down(), as hetero's stage processes would be.
        stray = subprocess.Popen(link.exec(1, ["sleep", "600"]), start_new_session=True)
    finally:
        link.down()
    assert stray.wait(timeout=15) is not None
    assert not set(link.ns) & _netns_names()
    for dev in link.veth:
        assert subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode != 0
    link.down()  # twice is harmless


def test_rates_in_tc_spelling() -> None:
    import w3_net

    assert w3_net.parse_rate("1gbit") == 1e9
    assert w3_net.parse_rate("100mbit") == 1e8
    with pytest.raises(ValueError):
        w3_net.parse_rate("fast")
