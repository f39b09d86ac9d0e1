"""One command starts every host: `hetero run` starts host beta's `hetero worker` over ssh.

The process tests start a real OpenSSH server on 127.0.0.1 (key authentication, its own host key and
authorized_keys in a temporary directory) and log in to it as the current user, so "beta" is this
machine reached the way a remote host is. They skip where /usr/sbin/sshd, ssh or ssh-keygen is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from plans import free_ports, make_plan
from procs import STARTED, clean_up, finish, start
from sshd_server import (
    Sshd,
    _assert_nothing_left,
    _processes_naming,
    _sessions,
    _with_host,
    sshd,  # noqa: F401 (a fixture: an OpenSSH server on loopback)
)

from hetero.errors import ConfigError
from hetero.hardware import build_cluster
from hetero.plan import Plan, compute_input_hash
from hetero.profile import fleet_hash
from hetero.runtime.run.ssh import CHECK_PREFIX, remote_word, ssh_argv, ssh_hosts, worker_command
from hetero.specs import ModelSpec, SshSpec, TrainSpec

TRAIN = TrainSpec(micro_batch_size=1, num_micro_batches=2, steps=2, lr=1e-3)
LONG = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=400, lr=1e-3)  # stopped long before its end


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    clean_up()


# -- the fleet file's ssh settings (no ssh needed) ---------------------------------------------------------


def _fleet(ssh: object) -> dict:
    return {"hosts": [{"name": "alpha", "address": "10.0.0.1", "devices": ["cpu"]},
                      {"name": "beta", "address": "10.0.0.2", "devices": ["cpu"], "ssh": ssh}],
            "default_link": {"bandwidth_gbps": 1}}


def test_fleet_ssh_keys_parse_and_bad_values_are_one_line() -> None:
    assert build_cluster(_fleet("me@strix")).host("beta").ssh == SshSpec("me@strix")
    full = {"target": "me@strix", "port": 2222, "identity": "~/.ssh/id_ed25519", "options": ["ConnectTimeout=5"],
            "python": "~/venvs/hetero/bin/python", "plan_dir": "~/plans/demo"}
    assert build_cluster(_fleet(full)).host("beta").ssh == SshSpec(**full)
    for bad, expected in [
        (7, "hardware.hosts[1].ssh must be [user@]host or a mapping"),
        ({"port": 22}, "hardware.hosts[1].ssh: missing 'target'"),
        ({"target": "-oProxyCommand=touch /tmp/x"}, "hardware.hosts[1].ssh.target must be [user@]host"),
        ({"target": "me@strix", "port": 70000}, "hardware.hosts[1].ssh.port must be at most 65535"),
        ({"target": "me@strix", "port": "22"}, "hardware.hosts[1].ssh.port must be an integer"),
        ({"target": "me@strix", "options": "BatchMode=no"}, "hardware.hosts[1].ssh.options must be a list"),
        ({"target": "me@strix", "options": ["-v"]}, "hardware.hosts[1].ssh.options[0] must be KEY=VALUE"),
        ({"target": "me@strix", "python": ""}, "hardware.hosts[1].ssh.python must be a path"),
        ({"target": "me@strix", "venv": "x"}, "hardware.hosts[1].ssh: unknown key(s) ['venv']"),
    ]:
        with pytest.raises(ConfigError) as err:
            build_cluster(_fleet(bad))
        assert expected in str(err.value) and "\n" not in str(err.value), (bad, str(err.value))


def test_ssh_settings_change_neither_the_fleet_hash_nor_the_plan_hash(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                      tmp_path: Path) -> None:
    assert fleet_hash(build_cluster(_fleet("me@strix"))) == fleet_hash(build_cluster(_fleet(None)))
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN, hosts=["alpha", "beta"])
    plan.save(tmp_path / "plan.json")
    before = (tmp_path / "plan.json").read_text()
    assert '"ssh"' not in before  # a plan without ssh settings is written as before they existed
    plan = _with_host(plan, "beta", ssh=SshSpec("me@strix", python="~/venv/bin/python"))
    assert compute_input_hash(plan) == plan.input_hash
    plan.save(tmp_path / "with-ssh.json")
    assert Plan.load(tmp_path / "with-ssh.json").cluster.host("beta").ssh == plan.cluster.host("beta").ssh
    # Added to plan.json by hand (no recompiling): the hash still matches, a bad value is one line.
    data = json.loads(before)
    data["cluster"]["hosts"][1]["ssh"] = {"target": "-oProxyCommand=x"}
    (tmp_path / "edited.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match=r"cluster.hosts\[1\].ssh.target must be \[user@\]host"):
        Plan.load(tmp_path / "edited.json")


def test_a_coordinator_on_loopback_is_refused_for_a_host_elsewhere(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                   tmp_path: Path) -> None:
    from hetero.runtime.run.ssh import RemoteHostError, check_ssh_hosts, ssh_hosts

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN, hosts=["alpha", "beta"])
    # alpha keeps the fleet's default address, 127.0.0.1
    plan = _with_host(plan, "beta", address="10.0.0.2", ssh=SshSpec("me@10.0.0.2"))
    hosts = ssh_hosts(plan, tmp_path / "plan.json", "alpha")
    assert [(h.name, h.plan) for h in hosts] == [("beta", f"{tmp_path}/plan.json")]
    with pytest.raises(RemoteHostError, match=r"^the coordinator's host alpha has address 127.0.0.1, where host "
                                              r"beta \(10.0.0.2\) cannot reach it: give alpha an address"):
        check_ssh_hosts(plan, hosts, "alpha")  # before any ssh connection


def test_the_remote_command_is_quoted_for_the_remote_shell() -> None:
    ssh = SshSpec("me@strix", port=2222, options=["ConnectTimeout=3"], python="~/my venv/bin/python")
    argv = ssh_argv(ssh, [ssh.python, "-m", "hetero.cli", "worker", "/plans/a b; rm -rf x/plan.json"])
    assert argv[:3] == ["ssh", "-o", "ConnectTimeout=3"]  # the fleet's options first: ssh keeps the first value
    assert "BatchMode=yes" in argv and argv[argv.index("-p") + 1] == "2222"
    assert argv[-3:-1] == ["--", "me@strix"]
    assert argv[-1] == "~/'my venv/bin/python' -m hetero.cli worker '/plans/a b; rm -rf x/plan.json'"
    assert remote_word("~/plans") == "~/plans" and remote_word("~x") == "'~x'"


def test_the_remote_worker_starts_from_a_home_that_holds_the_clone(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                  tmp_path: Path) -> None:
    """ssh runs the worker's command with the remote shell in the user's home, where the clone of an editable
    install sits: the command imports the installed hetero, not that folder (issue 53)."""
    from procs import clone_beside

    plan = _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, SshSpec("me@beta", python=sys.executable))
    host = ssh_hosts(plan, tmp_path / "plan.json", "alpha")[0]
    command = ssh_argv(host.ssh, worker_command(host, "--check"))[-1]
    done = subprocess.run(["sh", "-c", command], cwd=clone_beside(tmp_path / "home"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith(CHECK_PREFIX))[len(CHECK_PREFIX):])
    assert report["error"] is None and report["input_hash"] == plan.input_hash, report


# -- a real sshd on 127.0.0.1 ------------------------------------------------------------------------------


def _ssh_plan(tmp_path: Path, tiny_model_dir: Path, tiny_spec: ModelSpec, ssh: SshSpec,
              train: TrainSpec = TRAIN) -> Plan:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=train, hosts=["alpha", "beta"])
    plan = _with_host(plan, "beta", ssh=ssh)
    plan.save(tmp_path / "plan.json")
    return plan


@pytest.mark.slow
def test_one_command_trains_over_ssh_and_a_stopped_run_leaves_nothing_on_any_host(
        sshd: Sshd, tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:  # noqa: F811 (the fixture)
    _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, sshd.ssh, LONG)
    run_dir = tmp_path / "run"
    run = start(["run", "plan.json", "--run-dir", str(run_dir), "--port", str(free_ports(1)[0]), "--no-progress"],
                tmp_path)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert run.poll() is None, finish(run)[2][-3000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    assert len(_sessions(sshd)) == 1
    run.send_signal(signal.SIGTERM)  # a checkpoint at the next step boundary, then every host stops
    code, out, err = finish(run, 120)
    assert code == 130 and "hetero: interrupted after step" in err, err[-3000:]
    assert "started hosts beta over ssh" in out and "waiting for hosts" not in out, out
    envs = json.loads((run_dir / "environments.json").read_text())
    assert [envs[f"stage{k}"]["host"] for k in range(2)] == ["alpha", "beta"]
    assert "hetero worker: host beta runs stages [1]" in (run_dir / "logs" / "host-beta.log").read_text()
    assert (tmp_path / "runs" / "run" / "logs" / "stage1.log").is_file()  # beta's run dir: PLAN_DIR/runs/<name>
    took = _assert_nothing_left(sshd, tmp_path)
    print(f"SIGTERM: nothing left on any host {took:.1f} s after `hetero run` exited")


# Starts beta's worker over ssh exactly as `hetero run` does (runtime/run/ssh.py SshWorkers), without the seconds
# a real run takes to import torch and train a step before it can be killed.
STAND_IN = """
import sys, time
from pathlib import Path
from hetero.plan import Plan
from hetero.runtime.run.ssh import SshWorkers, ssh_hosts
plan_path, run_dir, coordinator = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
workers = SshWorkers(ssh_hosts(Plan.load(plan_path), plan_path, "alpha"), run_dir)
workers.start(coordinator)
print(workers.procs["beta"].pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["hetero run", "ssh"])
def test_a_killed_run_or_dropped_session_leaves_nothing_on_the_ssh_host(
        sshd: Sshd, tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path, victim: str) -> None:  # noqa: F811 (the fixture)
    """SIGKILL: nobody stops anything. Killing `hetero run` closes its ssh client's stdin, killing the client
    closes the connection: either way the remote worker's stdin ends, and it stops its stages."""
    _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, sshd.ssh, LONG)
    run_dir = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-c", STAND_IN, str(tmp_path / "plan.json"), str(run_dir),
                            f"tcp://127.0.0.1:{free_ports(1)[0]}"], stdout=subprocess.PIPE, text=True)
    STARTED.append(run)
    ssh_pid = int(run.stdout.readline())
    log = run_dir / "logs" / "host-beta.log"
    deadline = time.monotonic() + 60
    while not (log.is_file() and "runs stages" in log.read_text()):  # beta's worker started its stage
        assert run.poll() is None and time.monotonic() < deadline, "beta's worker did not start"
        time.sleep(0.1)
    assert len(_sessions(sshd)) == 1 and len(_processes_naming(tmp_path)) >= 3  # ssh, worker, stage
    os.kill(run.pid if victim == "hetero run" else ssh_pid, signal.SIGKILL)
    took = _assert_nothing_left(sshd, tmp_path, exclude=run.pid)
    if victim == "hetero run":  # (a dropped session takes the worker's last words with it)
        assert "hetero worker: stdin closed" in log.read_text()
    print(f"{victim} killed: nothing left on beta {took:.1f} s later")


@pytest.mark.slow
def test_a_remote_worker_that_ends_early_is_one_line_naming_the_host_and_its_log(
        sshd: Sshd, tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path, capsys: pytest.CaptureFixture,  # noqa: F811 (the fixture)
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hetero.cli import main

    python = tmp_path / "python-that-fails"  # answers the check, then fails as a broken install would
    python.write_text(f'#!/bin/sh\ncase "$*" in *--check*) exec {sys.executable} "$@";; esac\n'
                      'echo "ImportError: libtorch_cpu.so: cannot open shared object file" >&2\nexit 3\n')
    python.chmod(0o755)
    _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, replace(sshd.ssh, python=str(python)), LONG)
    monkeypatch.chdir(tmp_path)  # in this process: no second import of torch
    run_dir = tmp_path / "run"
    assert main(["run", "plan.json", "--run-dir", str(run_dir), "--port", str(free_ports(1)[0]), "--no-progress"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0] == ("hetero: error: host beta's `hetero worker`, started over ssh, ended: exit code 3: "
                        "ImportError: libtorch_cpu.so: cannot open shared object file "
                        f"(log: {run_dir / 'logs' / 'host-beta.log'})"), lines[0]
    _assert_nothing_left(sshd, tmp_path)


def _refusal(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> str:
    from hetero.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["run", "plan.json", "--run-dir", "run", "--port", str(free_ports(1)[0])]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was created
    return lines[0]


@pytest.mark.slow
def test_preflight_refuses_a_host_with_another_plan_in_one_line(
        sshd: Sshd, tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path, capsys: pytest.CaptureFixture,  # noqa: F811 (the fixture)
        monkeypatch: pytest.MonkeyPatch) -> None:
    there = tmp_path / "on-beta"
    there.mkdir()
    plan = _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, replace(sshd.ssh, plan_dir=str(there)))
    other = replace(plan, model=replace(plan.model, lora=replace(plan.model.lora, r=4)))
    other = replace(other, input_hash=compute_input_hash(other))
    other.save(there / "plan.json")
    line = _refusal(tmp_path, capsys, monkeypatch)
    assert (f"host beta ({sshd.ssh.target}) has another plan.json at {there / 'plan.json'} "
            f"(hash {other.input_hash}, this one {plan.input_hash}): copy {tmp_path} there, e.g. "
            f"`rsync -a -e 'ssh -p {sshd.ssh.port}' {tmp_path}/ {sshd.ssh.target}:{there}/`") in line, line

    (there / "plan.json").unlink()
    assert f"host beta ({sshd.ssh.target}) has no {there / 'plan.json'}: copy {tmp_path} there" in _refusal(
        tmp_path, capsys, monkeypatch)

    _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, replace(sshd.ssh, python="/nonexistent/python3"))
    assert f"host beta ({sshd.ssh.target}) has no /nonexistent/python3" in _refusal(tmp_path, capsys, monkeypatch)

    stranger = tmp_path / "stranger_key"  # a key beta does not know: ssh's own reason, and what to do
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True, timeout=30)
    _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, replace(sshd.ssh, identity=str(stranger)))
    line = _refusal(tmp_path, capsys, monkeypatch)
    assert f"cannot reach host beta ({sshd.ssh.target}) over ssh: " in line and "Permission denied" in line, line
    assert f"set up key authentication (`ssh-copy-id {sshd.ssh.target}`" in line, line


def test_preflight_shows_ssh_s_own_reason_when_a_host_is_unreachable(
        tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("ssh") is None:
        pytest.skip("needs the OpenSSH client ssh")
    port = free_ports(1)[0]  # nothing listens there
    _ssh_plan(tmp_path, tiny_model_dir, tiny_spec, SshSpec("me@127.0.0.1", port=port))
    line = _refusal(tmp_path, capsys, monkeypatch)
    assert f"cannot reach host beta (me@127.0.0.1) over ssh: ssh: connect to host 127.0.0.1 port {port}: " \
           "Connection refused: fix its ssh settings" in line, line
