"""An anonymous connection flood against every port a run listens on: the run trains as if nothing happened.

While a 2-stage tiny run trains, a local process with no key opens IDLE idle TCP connections to each
port the run listens on (the coordinator's and each stage's), opens them again as the run drops them,
and churns more (connect, then close at once). The run's processes start under a soft `ulimit -n`
of 1024, the common default, where this flood used to end the run with EMFILE. The run must exit 0
with the per-step losses of the same plan run undisturbed.
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from metrics_rows import read_metrics, step_lines
from plans import free_ports, make_plan
from procs import STARTED, clean_up, finish, start

import hetero.runtime.wire.inbox as inbox_module
from hetero.plan import Plan
from hetero.runtime.wire.transport import Transport
from hetero.security import generate
from hetero.specs import ModelSpec, TrainSpec

IDLE = 2000  # idle connections opened to each port
SOFT_NOFILE = 1024  # the run's processes start with this soft limit on open files
STEPS = 60  # long enough for the flood to be full while the run trains
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=STEPS, lr=1e-3)

# The attacker: no key, no ZeroMQ, only sockets. It never sends a byte on its idle connections (it reads
# and ignores the ZeroMQ greeting), opens one again when the run drops it, and churns one connection per
# port per round (at most CHURN in flight: a connect to a full backlog stays pending for minutes, and unbounded
# they would exhaust the attacker's own descriptors). Prints "flooding" once every port has had IDLE idle connections, and its counts on SIGTERM.
ATTACKER = r"""
import errno, json, resource, selectors, signal, socket, sys

idle, ports = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
CHURN = 50  # churn connections in flight per port, at most
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # its own connections must not run out first
stats = {p: {"opened": 0, "held": 0, "most_held": 0, "dropped_by_run": 0, "churned": 0} for p in ports}
connecting = {p: 0 for p in ports}
churning = {p: 0 for p in ports}  # churn connections not yet connected (a full backlog keeps them pending)
sel = selectors.DefaultSelector()  # epoll: thousands of descriptors
state = {}  # socket -> (port, "idle" | "churn" | "connecting")
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))


def open_one(port, kind):
    try:
        s = socket.socket()
    except OSError:  # out of descriptors itself: try again next round rather than die
        return
    s.setblocking(False)
    if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
        s.close()
        return
    state[s] = (port, kind)
    sel.register(s, selectors.EVENT_WRITE)
    if kind == "connecting":
        connecting[port] += 1
    else:
        churning[port] += 1


def close(s):
    sel.unregister(s)
    del state[s]
    s.close()


def on_ready(s, events):
    port, kind = state[s]
    st = stats[port]
    if kind == "idle":
        try:
            data = s.recv(4096)  # the run's greeting, ignored; b"" once the run dropped us
        except OSError:
            data = b""
        if not data:
            st["held"] -= 1
            st["dropped_by_run"] += 1
            close(s)
        return
    failed = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if kind == "churn" or failed:
        st["churned"] += kind == "churn" and not failed
        connecting[port] -= kind == "connecting"
        churning[port] -= kind == "churn"
        close(s)
        return
    connecting[port] -= 1
    state[s] = (port, "idle")
    sel.modify(s, selectors.EVENT_READ)
    st["opened"] += 1
    st["held"] += 1
    st["most_held"] = max(st["most_held"], st["held"])


announced = False
while not stop:
    for p in ports:
        for _ in range(max(0, min(50, idle - stats[p]["held"] - connecting[p]))):
            open_one(p, "connecting")
        if churning[p] < CHURN:
            open_one(p, "churn")
    for key, events in sel.select(timeout=0.05):
        on_ready(key.fileobj, events)
    if not announced and all(stats[p]["opened"] >= idle for p in ports):
        announced = True
        print("flooding", flush=True)
print(json.dumps(stats), flush=True)
"""


# -- one inbox, in one process ----------------------------------------------------------------------------


def test_an_idle_connection_without_a_handshake_is_dropped_and_a_real_peer_still_connects(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inbox_module, "INBOX_HANDSHAKE_S", 1.0)
    with Transport("stage1", "tcp://127.0.0.1:0", "plan", recv_timeout_s=10) as inbox:
        assert inbox.endpoint
        port = _port(inbox.endpoint)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        t0 = time.monotonic()
        for s in idle:  # the inbox's greeting, then nothing: it drops us (b"" or a reset)
            with contextlib.suppress(ConnectionResetError):
                while s.recv(4096):
                    pass
        took = time.monotonic() - t0
        assert took < 1.0 + 3.0, f"idle connections were dropped only after {took:.1f} s"
        with Transport("stage0", None, "plan") as peer:
            peer.connect("stage1", inbox.endpoint)
            peer.send("stage1", "heartbeat")
            assert inbox.recv("heartbeat").sender == "stage0"
        for s in idle:
            s.close()
        gate = inbox._gate
        assert gate is not None
        deadline = time.monotonic() + 5.0  # its thread logs them
        while gate.refused < len(idle) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.refused == len(idle)


OUT_OF_DESCRIPTORS = r"""
import logging, os, resource, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
from hetero.runtime.wire.transport import Transport

inbox = Transport("stage1", "tcp://127.0.0.1:0", "plan", recv_timeout_s=30)
peer = Transport("stage0", None, "plan")
peer.connect("stage1", inbox.endpoint)
peer.send("stage1", "heartbeat", step=0)
inbox.recv("heartbeat", step=0)  # connected before the flood
# A few descriptors above what it holds now: the listen backlog alone is more than that, however slow the machine.
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(inbox.endpoint, flush=True)
sys.stdin.readline()  # the flood holds every descriptor the inbox may open
for step in range(1, 4):
    peer.send("stage1", "heartbeat", step=step)
    inbox.recv("heartbeat", step=step)
deadline = time.monotonic() + 20  # the watch thread counts the failure from the monitor's event
while inbox._gate.accept_failures == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
print("served", inbox._gate.accept_failures, flush=True)
sys.stdin.readline()
peer.close()
inbox.close()
"""


def test_an_inbox_out_of_descriptors_says_so_once_and_serves_its_peers() -> None:
    proc = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS, "16"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(proc)
    held: list[socket.socket] = []
    try:
        assert proc.stdin and proc.stdout
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("tcp://127.0.0.1:"), proc.communicate()[1][-3000:]
        for _ in range(400):  # more than it may hold: the kernel queues what it cannot accept
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", _port(endpoint)))
            held.append(s)
        time.sleep(1.0)
        proc.stdin.write("\n")
        proc.stdin.flush()
        served = proc.stdout.readline().split()
        assert served[:1] == ["served"] and int(served[1]) > 0, (served, proc.communicate()[1][-3000:])
        proc.stdin.write("\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=30)
    finally:
        for s in held:
            s.close()
    lines = [ln for ln in err.splitlines() if "cannot accept" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    # The address is the inbox's own (IPv4-mapped): a connection that was never accepted has no peer address.
    assert re.match(rf"stage1 cannot accept connections on tcp://\S+:{_port(endpoint)}: EMFILE \(Too many open "
                    r"files\), 1 failed so far: .* Training goes on", lines[0]), lines[0]
    assert proc.returncode == 0


# -- a real run ----------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    clean_up()


def _port(endpoint: str) -> int:
    return int(urlsplit(endpoint).port or 0)


def _start_run(tmp_path: Path, name: str, port: int) -> subprocess.Popen:
    """`hetero run` under a soft open-file limit of SOFT_NOFILE (its stages inherit it)."""
    return start(["run", "plan.json", "--run-dir", name, "--port", str(port), "--no-progress"], tmp_path,
                 nofile=SOFT_NOFILE)


def _losses(run_dir: Path) -> list[float]:
    path = run_dir / "metrics.jsonl"
    return [m["loss"] for m in step_lines(read_metrics(path))] if path.is_file() else []


def _wait_for_training(run: subprocess.Popen, run_dir: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not _losses(run_dir):
        if run.poll() is not None or time.monotonic() > deadline:
            out, err = run.communicate()
            raise AssertionError(f"the run never trained (exit {run.returncode})\n{err[-3000:]}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_unkeyed_connection_flood_on_every_port_changes_nothing(tmp_path: Path, tiny_model_dir: Path,
                                                                   tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN)
    plan = replace(plan, security=generate("token", [s.host for s in plan.stages], tmp_path))
    plan.save(tmp_path / "plan.json")
    ports = [free_ports(1)[0], *(_port(s.endpoint) for s in Plan.load(tmp_path / "plan.json").stages)]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < len(ports) * (IDLE + 50) + 100:  # idle + churn in flight per port, and its own few
        pytest.skip(f"the attacker needs {len(ports) * (IDLE + 50) + 100} open files; the hard limit is {hard}")

    reference = _start_run(tmp_path, "reference", ports[0])
    code, _, err = finish(reference, 600)
    assert code == 0, err[-3000:]
    undisturbed = _losses(tmp_path / "reference")
    assert len(undisturbed) == STEPS

    run_dir = tmp_path / "flooded"
    run = _start_run(tmp_path, "flooded", ports[0])
    _wait_for_training(run, run_dir)
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(IDLE), *map(str, ports)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    flooding: list[int] = []  # the steps done when every port had had IDLE idle connections

    def read_attacker() -> None:
        for line in attacker.stdout or []:
            lines.append(line)
            if line == "flooding\n":
                flooding.append(len(_losses(run_dir)))

    reader = threading.Thread(target=read_attacker, daemon=True)
    reader.start()
    try:
        code, _, err = finish(run, 600)
        attacker.send_signal(signal.SIGTERM)
        attacker.wait(timeout=30)
    finally:
        attacker.kill()  # no-op once it exited
        attacker.wait()
        reader.join(10)
    assert lines and lines[-1].startswith("{"), f"the attacker ended without its counts: {attacker.stderr.read()[-3000:]}"
    stats = {int(p): s for p, s in json.loads(lines[-1]).items()}
    print(f"flood: {json.dumps(stats)}; steps done when it was full: {flooding}")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert flooding and flooding[0] < STEPS, f"the run ended before the flood was full: {stats}"
    for port in ports:
        assert stats[port]["opened"] >= IDLE and stats[port]["churned"] > 0, (port, stats[port])
    assert _losses(run_dir) == pytest.approx(undisturbed, abs=1e-6, rel=0)
