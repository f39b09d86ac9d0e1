"""`hetero profile` across two hosts (two network namespaces joined by a veth pair) is as closed as `hetero run`:
a process without the session's keys can neither drive a profile worker nor answer for one, its traffic is
encrypted on the wire, and killing `hetero profile` leaves no worker behind on either host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (ip netns)")]

FLEET = """name: twohosts
hosts:
  - name: a
    address: {a}
    port: 29500
    devices: [{{type: cpu, count: 1, threads: 1}}]
  - name: b
    address: {b}
    port: 29500
    devices: [{{type: cpu, count: 1, threads: 1}}]
links:
  - {{a: a, b: b, bandwidth_gbps: 10, latency_us: 50}}
"""

# Reads every frame on an interface and counts bytes; at SIGTERM prints which of the markers it saw, as JSON.
SNIFFER = r"""
import json, signal, socket, sys
markers = [m.encode() for m in sys.argv[2:]]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.setsockopt(socket.SOL_SOCKET, 33, 1 << 28)  # SO_RCVBUFFORCE (root): no frame dropped while this reads
s.bind((sys.argv[1], 0))
seen, total, tail = set(), 0, b""
def done(*_):
    print(json.dumps({"bytes": total, "seen": sorted(m.decode() for m in seen)}), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
print("ready", flush=True)
while True:
    frame = s.recv(1 << 20)  # a GSO frame may be far above the MTU
    total += len(frame)
    window = tail + frame
    seen.update(m for m in markers if m in window)
    tail = frame[-64:]
"""

# Without the session's keys: forge a worker's error to the coordinator and the coordinator's stop to worker a,
# logging in every way a stranger can (no key; its own CURVE key; worker b's public key with its own secret); and
# one plain TCP line (the sniffer's control: it must see that).
ATTACKER = r"""
import json, socket, sys, time, zmq
from hetero.runtime.wire.frames import Message, encode
session = json.load(open(sys.argv[1]))
worker_a, control = sys.argv[2], sys.argv[3]
keys, token = session["security"]["public_keys"], session["token"]
ctx = zmq.Context()
pub, sec = zmq.curve_keypair()
def forge(endpoint, server, claimed, kind, meta):
    frames = encode(Message(kind=kind, sender=claimed, step=0, mb=-1, meta=meta, tensors={}), token)
    for login in ({}, {"curve_publickey": pub, "curve_secretkey": sec, "curve_serverkey": keys[server].encode()},
                  {"curve_publickey": keys[claimed].encode(), "curve_secretkey": sec,
                   "curve_serverkey": keys[server].encode()}):
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 0
        for name, value in login.items():
            setattr(sock, name, value)
        sock.connect(endpoint)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
forge(session["coordinator"], "coordinator", "profile:b.cpu0", "error", {"device": "b.cpu0", "message": "FORGED"})
forge(worker_a, "profile:a.cpu0", "coordinator", "stop", {})
host, port = session["coordinator"].removeprefix("tcp://").rsplit(":", 1)
with socket.create_connection((host, int(port)), 5) as raw:
    raw.sendall(control.encode() + b"\n")
time.sleep(5)
print("forged", flush=True)
"""

CONTROL = "SNIFFER-SEES-PLAINTEXT-4711"
# In the clear, each of these would cross the link: a message key of a device profile, b's device name, a layer kind.
SECRETS = ("measured_with", "b.cpu0", "decoder")


@pytest.fixture()
def hosts(tmp_path: Path) -> Iterator[object]:
    import w3_net

    if (refused := w3_net.netns_refused()) is not None:
        pytest.skip(f"ip netns refused: {refused}")
    link = w3_net.LinkPair()
    try:
        link.up()
        yield link
    finally:
        link.down()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}


def _wait_for(what: str, ok, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _listening(log: Path) -> str | None:
    """The endpoint a worker logged it listens on."""
    text = log.read_text() if log.is_file() else ""
    return next((line.split(" listening on ")[1].split()[0] for line in text.splitlines() if " listening on " in line),
                None)


def _workers(out: str) -> list[int]:
    """Pids of the profile workers of the profile written to ``out``, still running, on either host."""
    marker = f"{out}/profile-session/".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hetero.runtime.tools.profile_worker" in cmd and any(marker in arg for arg in cmd):
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] if (proc / "stat").exists() else "?"
            if state != "Z":
                pids.append(int(proc.name))
    return pids


def _start_profile(link, tmp_path: Path, out: str) -> tuple[subprocess.Popen, Path, subprocess.Popen]:
    """`hetero profile` on host a; once it has written its session, host b's worker as the command it printed."""
    profile = subprocess.Popen(link.exec(0, [sys.executable, "-m", "hetero.cli", "profile", "model=tiny", "-cd",
                                             str(tmp_path / "fleets"), "hardware=twohosts", f"output={out}/profile.json"]),
                               cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    session = tmp_path / out / "profile-session" / "session.json"
    _wait_for("session.json", session.is_file)
    worker_b = subprocess.Popen(link.exec(1, [sys.executable, "-m", "hetero.runtime.tools.profile_worker", "--session",
                                              str(session), "--device", "b.cpu0"]),
                                cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return profile, session, worker_b


def test_profile_on_two_hosts_admits_only_its_keys_encrypts_and_leaves_no_worker(hosts, tmp_path: Path) -> None:
    import w3_net

    link = hosts
    (tmp_path / "fleets" / "hardware").mkdir(parents=True)
    (tmp_path / "fleets" / "hardware" / "twohosts.yaml").write_text(FLEET.format(a=w3_net.IPS[0], b=w3_net.IPS[1]))
    sniffer = subprocess.Popen(link.exec(1, [sys.executable, "-c", SNIFFER, link.veth[1], CONTROL, *SECRETS]),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert sniffer.stdout is not None and sniffer.stdout.readline().strip() == "ready", sniffer.stderr

    profile, session, worker_b = _start_profile(link, tmp_path, "one")
    assert json.loads(session.read_text())["security"]["mode"] == "curve"  # off loopback, as `hetero compile` chooses
    log_a = tmp_path / "one" / "profile-logs" / "a.cpu0.log"
    _wait_for("worker a's endpoint", lambda: _listening(log_a) is not None)
    attacker = subprocess.run(link.exec(1, [sys.executable, "-c", ATTACKER, str(session), _listening(log_a) or "",
                                            CONTROL]), env=_env(), capture_output=True, text=True, timeout=120)
    assert attacker.returncode == 0 and "forged" in attacker.stdout, attacker.stderr[-2000:]
    out, err = profile.communicate(timeout=600)
    assert profile.returncode == 0, err[-3000:]  # neither the forged error nor the forged stop was taken
    assert worker_b.wait(timeout=30) == 0
    sniffer.send_signal(signal.SIGTERM)
    sniffed = json.loads(sniffer.communicate(timeout=30)[0].strip().splitlines()[-1])

    # What was measured is the workers' own: both devices, sane decoder times (not a forgery's).
    measured = json.loads((tmp_path / "one" / "profile.json").read_text())
    assert [d["device"] for d in measured["devices"]] == ["a.cpu0", "b.cpu0"]
    assert all(0 < d["layers"]["decoder"]["fwd"]["b_s_per_token"] < 1e-3 for d in measured["devices"])
    assert "wrote" in out
    # The forgeries were refused at the handshake, and said so: worker a's log, the profile's own stderr.
    assert "refused a connection" in log_a.read_text()
    assert "coordinator refused a connection" in err, err[-3000:]
    # The link carried the profile (the 4 MB link probes at least) and the control line in the clear, and no
    # plaintext of the profile's messages.
    assert sniffed["bytes"] > 20e6, sniffed
    assert sniffed["seen"] == [CONTROL], sniffed
    # The session's keys are gone with it.
    assert not (tmp_path / "one" / "profile-session" / "artifacts").exists()

    # Killed while measuring: its workers, here and on the other host, end on their own within 15 s.
    profile, session, worker_b = _start_profile(link, tmp_path, "two")
    log_a = tmp_path / "two" / "profile-logs" / "a.cpu0.log"
    _wait_for("both workers", lambda: len(_workers("two")) == 2 and _listening(log_a) is not None)
    time.sleep(3)  # hellos said; a.cpu0 is measuring
    assert len(_workers("two")) == 2
    os.killpg(profile.pid, signal.SIGKILL)  # `hetero profile`, and only it: the workers have sessions of their own
    profile.wait(timeout=10)
    killed = time.monotonic()
    _wait_for("no worker left", lambda: not _workers("two"), timeout_s=15)
    assert time.monotonic() - killed < 15
    assert worker_b.wait(timeout=5) != 0
