"""Support for the tests (helpers, not tests): an OpenSSH server of the test's own on loopback (a module
fixture), a client spec for it, and the checks that a run left nothing on its host."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from plans import free_ports

from hetero.plan import Plan
from hetero.specs import SshSpec

SSHD = Path("/usr/sbin/sshd")


@dataclass
class Sshd:
    pid: int
    ssh: SshSpec  # how to reach it, python = this interpreter


def _wait_port(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"sshd exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"sshd did not listen on port {port}: {log.read_text()[-2000:]}")


def needs_sshd() -> None:
    if not SSHD.is_file() or shutil.which("ssh-keygen") is None or shutil.which("ssh") is None:
        pytest.skip("needs the OpenSSH server /usr/sbin/sshd, ssh and ssh-keygen (Debian: apt-get install "
                    "openssh-server)")
    if os.geteuid() == 0 and not Path("/run/sshd").is_dir():
        # sshd started by root insists on its privilege separation directory (the service unit makes it at boot)
        Path("/run/sshd").mkdir(mode=0o755)


def write_sshd(root: Path, port: int, listen: str) -> tuple[Path, Path]:
    """An OpenSSH server's files under ``root`` (host and client keys, authorized_keys, sshd_config for
    ``listen``:``port``); returns (its config, its log)."""
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True, timeout=30)
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    (root / "sshd_config").write_text(
        f"Port {port}\nListenAddress {listen}\nHostKey {root / 'host_key'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nStrictModes no\nPidFile none\nUsePAM no\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
        "AllowTcpForwarding no\nX11Forwarding no\nPrintMotd no\n")
    return root / "sshd_config", root / "sshd.log"


def client_spec(root: Path, address: str, port: int) -> SshSpec:
    """The fleet file's ssh settings that log in to ``write_sshd(root, ...)``'s server as this user."""
    options = [f"UserKnownHostsFile={root / 'known_hosts'}", "StrictHostKeyChecking=accept-new", "IdentitiesOnly=yes",
               "LogLevel=ERROR"]
    return SshSpec(f"{getpass.getuser()}@{address}", port=port, identity=str(root / "client_key"), options=options,
                   python=sys.executable)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    needs_sshd()
    root = tmp_path_factory.mktemp("sshd")
    port = free_ports(1)[0]
    config, log = write_sshd(root, port, "127.0.0.1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, log)
        yield Sshd(proc.pid, client_spec(root, "127.0.0.1", port))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _sessions(sshd: Sshd) -> list[int]:
    """The live children of the listening sshd: one per ssh connection still open."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(sshd.pid) and fields[0] != "Z":
            found.append(int(proc.name))
    return found


def _processes_naming(path: Path, exclude: int | None = None) -> list[str]:
    """Live processes whose command line names ``path`` (ssh clients, workers and stages all name the plan)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in (os.getpid(), exclude):
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(path) in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def _assert_nothing_left(sshd: Sshd, plan_dir: Path, within_s: float = 20.0, exclude: int | None = None) -> float:
    """Wait until no process of the run is left (here or "on beta"); returns how long that took."""
    t0 = time.monotonic()
    while (_processes_naming(plan_dir, exclude) or _sessions(sshd)) and time.monotonic() - t0 < within_s:
        time.sleep(0.2)
    assert _processes_naming(plan_dir, exclude) == [], "processes outlived the run"
    assert _sessions(sshd) == [], "ssh sessions outlived the run"
    return time.monotonic() - t0


def _with_host(plan: Plan, name: str, **changes: Any) -> Plan:
    """``plan`` with host ``name``'s settings changed (ssh, address)."""
    hosts = [replace(h, **changes) if h.name == name else h for h in plan.cluster.hosts]
    return replace(plan, cluster=replace(plan.cluster, hosts=hosts))
