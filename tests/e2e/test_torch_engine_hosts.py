"""`hetero run --engine torch` across two hosts: two network namespaces joined by a veth pair, host b with
its own OpenSSH server, `hetero run` on host a starting b's torch launcher over ssh.

The runs train like transformers+peft in one process (the reference of test_torch_engine.py): 2 hosts x 2
stages, and 2 hosts x (1 stage x 2 replicas) -- a mesh whose replicas' first stages share host a, so a
replica's ranks are not consecutive. Killing a rank on host b ends every process on both hosts within 30 s
with one line naming the rank and host, and the run continues on hetero's engine with --resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from metrics_rows import read_metrics, step_lines
from plans import SEQ_LEN, TRAIN, free_ports, make_plan
from runs import _check_against_reference
from sshd_server import SSHD, client_spec, needs_sshd, write_sshd

from hetero.plan import Plan, compute_input_hash
from hetero.runtime.torch_engine.rank import node_hosts, rank_order
from hetero.specs import ModelSpec

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (ip netns)")]


def test_ranks_go_host_by_host_and_the_mesh_follows_the_plan(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, split=[[3, 3], [3, 3]], train=TRAIN,  # type: ignore[list-item]
                     seq_len=SEQ_LEN, shares=[2, 2], hosts=["a", "b", "a", "b"])
    assert node_hosts(plan) == ["a", "b"]
    order = rank_order(plan)  # torch's launcher: node a's ranks 0, 1, then node b's 2, 3
    assert [plan.stages[k].host for k in order] == ["a", "a", "b", "b"]
    assert order == [0, 2, 1, 3]  # replica 0 = stages 0, 1 = ranks 0, 2: not consecutive


@pytest.fixture(scope="module")
def two_hosts(references: Callable[..., dict], tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Any:
    import w3_net

    if (refused := w3_net.netns_refused()) is not None:
        pytest.skip(f"ip netns refused: {refused}")
    needs_sshd()
    root = tmp_path_factory.mktemp("hosts")
    link = w3_net.LinkPair()
    sshd = None
    try:
        link.up()
        port = 2222
        config, log = write_sshd(root, port, w3_net.IPS[1])
        with open(log, "wb") as out:
            sshd = subprocess.Popen(link.exec(1, [str(SSHD), "-D", "-e", "-f", str(config)]), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while "Server listening" not in log.read_text():
            assert sshd.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        yield {"link": link, "ssh": client_spec(root, w3_net.IPS[1], port), "ips": w3_net.IPS,
               "reference": references(tiny_model_dir, TRAIN, SEQ_LEN, packing=False)}
    finally:
        if sshd is not None:
            sshd.terminate()
        link.down()


def _plan(hosts: Any, tiny_model_dir: Path, tiny_spec: ModelSpec, where: list[str], **kwargs: Any) -> Plan:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, train=TRAIN, seq_len=SEQ_LEN,
                     lora=hosts["reference"]["lora"], hosts=where, **kwargs)
    port_a, port_b = free_ports(2)
    specs = {"a": {"address": hosts["ips"][0], "port": port_a},
             "b": {"address": hosts["ips"][1], "port": port_b, "ssh": hosts["ssh"]}}
    cluster = replace(plan.cluster, hosts=[replace(h, **specs[h.name]) for h in plan.cluster.hosts])
    return replace(plan, cluster=cluster)


def _run(hosts: Any, plan: Plan, tmp_path: Path, *extra: str) -> subprocess.Popen:
    plan = replace(plan, input_hash=compute_input_hash(plan))  # the fleet's addresses are the test's
    plan.save(tmp_path / "plan.json")
    argv = [sys.executable, "-m", "hetero.cli", "run", "plan.json", "--engine", "torch", "--run-dir", "run",
            "--no-progress", *extra]
    return subprocess.Popen(hosts["link"].exec(0, argv), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"did not finish in {timeout} s\n{out[-3000:]}\n{err[-3000:]}") from None
    return proc.returncode, out, err


def _in_namespace(hosts: Any, side: int, tmp_path: Path, sessions: bool = True) -> list[int]:
    """Live processes of this test's plan in namespace ``side`` (torch's launcher, its ranks, ssh, and sshd's
    sessions unless ``sessions`` is False)."""
    out = subprocess.run(["ip", "netns", "pids", hosts["link"].ns[side]], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        session = sessions and "sshd:" in cmd and "[listener]" not in cmd
        if state != "Z" and (str(tmp_path) in cmd or "multiprocessing" in cmd or session):
            found.append(pid)
    return found


# Two stages on each host as a pipeline that comes back to host a ("a, b, b, a": its ranks 0, 2, 3, 1 are not in
# order) holds the plain layout's case ("a, a, b, b", its ranks in order: a layout of its own until 2026-12-03, 40 s of
# the suite) and the reordering besides; replicas split across the hosts are the other path.
@pytest.mark.parametrize("layout", ["2 hosts x (1 stage x 2 replicas)", "a, b, b, a"])
def test_one_command_trains_on_two_hosts_like_one_process(two_hosts: Any, tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                           tmp_path: Path, layout: str) -> None:
    if layout == "a, b, b, a":  # a pipeline that comes back to host a: its ranks 0, 2, 3, 1 are not in order
        plan = _plan(two_hosts, tiny_model_dir, tiny_spec, ["a", "b", "b", "a"], split=[1, 2, 2, 1])
    else:
        plan = _plan(two_hosts, tiny_model_dir, tiny_spec, ["a", "b", "a", "b"], split=[[3, 3], [3, 3]], shares=[2, 2])
    code, out, err = _finish(_run(two_hosts, plan, tmp_path))
    assert code == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "started hosts b over ssh" in out
    run_dir = tmp_path / "run"
    _check_against_reference(run_dir, two_hosts["reference"], list(range(1, TRAIN.steps + 1)), rtol=1e-5)
    beta = (run_dir / "logs" / "host-b.log").read_text()
    assert "hetero worker: host b runs ranks [2, 3] of --engine torch" in beta, beta[-2000:]
    assert [plan.stages[k].host for k in rank_order(plan)] == ["a", "a", "b", "b"]
    _nothing_left(two_hosts, tmp_path, time.monotonic(), 15)


def _nothing_left(hosts: Any, tmp_path: Path, t0: float, within_s: float, sessions: bool = True) -> None:
    def left() -> list[tuple[int, bytes]]:
        return [(side, Path(f"/proc/{pid}/cmdline").read_bytes()[:200]) for side in (0, 1)
                for pid in _in_namespace(hosts, side, tmp_path, sessions)]

    while left() and time.monotonic() - t0 < within_s:
        time.sleep(0.2)
    assert left() == []


def _started(hosts: Any, plan: Plan, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A long run, once it has trained 3 steps; and its metrics.jsonl."""
    run = _run(hosts, plan, tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while len(step_lines(read_metrics(metrics)) if metrics.is_file() else []) < 3:
        assert run.poll() is None, _finish(run)
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    return run, metrics


def _rank_processes_on_b(hosts: Any) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", hosts["link"].ns[1]], capture_output=True, text=True).stdout
    pids = []
    for pid in map(int, out.split()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:  # torch's launcher starts its ranks with multiprocessing's spawn
            pids.append(pid)
    return pids


def test_a_rank_killed_on_the_second_host_ends_both_hosts_in_one_line_and_resumes(
        two_hosts: Any, tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    long = replace(TRAIN, steps=400, checkpoint_every=2)
    plan = _plan(two_hosts, tiny_model_dir, tiny_spec, ["a", "a", "b", "b"], split=[1, 2, 2, 1])
    plan = replace(plan, train=long)
    run, metrics = _started(two_hosts, plan, tmp_path)
    victims = _rank_processes_on_b(two_hosts)
    assert len(victims) == 2, victims
    t0 = time.monotonic()
    os.kill(victims[-1], signal.SIGKILL)
    code, out, err = _finish(run, 60)
    lines = [ln for ln in err.splitlines() if ln.startswith("hetero: error:")]
    assert code != 0 and len(lines) == 1, err[-3000:]
    assert "host b" in lines[0] and "SIGKILL" in lines[0] and "rank 3" in lines[0], lines[0]
    _nothing_left(two_hosts, tmp_path, t0, 30)
    print(f"SIGKILL of rank 3 on host b: nothing left on either host {time.monotonic() - t0:.1f} s later; {lines[0]}")
    assert "continue after step" in lines[0] and "--resume run" in lines[0], lines[0]
    # hetero's engine continues the run from the torch engine's checkpoint, here on host a.
    done = max(m["step"] for m in step_lines(read_metrics(metrics)))
    one_host = make_plan(tiny_model_dir, tiny_spec.architecture, packing=False, train=long, seq_len=SEQ_LEN,
                         lora=two_hosts["reference"]["lora"], split=[3, 3])
    one_host.save(tmp_path / "plan-a.json")
    resumed = subprocess.run([sys.executable, "-m", "hetero.cli", "run", "plan-a.json", "--resume", "run", "--run-dir",
                              "resumed", "--no-progress", f"steps={done + 3}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [m["step"] for m in step_lines(read_metrics(tmp_path / "resumed" / "metrics.jsonl"))]
    assert steps and steps[0] <= done + 1 and steps[-1] == done + 3


def test_ctrl_c_on_the_launching_host_stops_every_host(two_hosts: Any, tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                      tmp_path: Path) -> None:
    plan = _plan(two_hosts, tiny_model_dir, tiny_spec, ["a", "a", "b", "b"], split=[1, 2, 2, 1])
    run, metrics = _started(two_hosts, replace(plan, train=replace(TRAIN, steps=400, checkpoint_every=2)), tmp_path)
    t0 = time.monotonic()
    run.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends `hetero run`
    code, _, err = _finish(run, 60)
    assert code == 130 and "hetero: stopped at once; newest checkpoint" in err and "--resume run" in err, err[-3000:]
    _nothing_left(two_hosts, tmp_path, t0, 30)


def test_a_host_that_drops_off_the_network_ends_the_run_on_both_hosts(two_hosts: Any, tiny_model_dir: Path,
                                                                     tiny_spec: ModelSpec, tmp_path: Path) -> None:
    """The link goes down mid-run (no process dies, no connection is closed): `hetero run` ends within 30 s
    with one line naming host b (ssh's keep-alives), and host b's launcher stops its ranks when node 0's
    rendezvous stops answering. (sshd's session on b, waiting on a dead TCP connection, is sshd's, not the run's.)"""
    plan = _plan(two_hosts, tiny_model_dir, tiny_spec, ["a", "a", "b", "b"], split=[1, 2, 2, 1])
    run, _ = _started(two_hosts, replace(plan, train=replace(TRAIN, steps=400, checkpoint_every=2)), tmp_path)
    link = two_hosts["link"]
    t0 = time.monotonic()
    subprocess.run(["ip", "-n", link.ns[1], "link", "set", link.veth[1], "down"], check=True, timeout=10)
    try:
        code, _, err = _finish(run, 45)
        took = time.monotonic() - t0
        lines = [ln for ln in err.splitlines() if ln.startswith("hetero: error:")]
        assert code != 0 and len(lines) == 1 and took < 30, (took, err[-3000:])
        assert "host b: its ssh session ended" in lines[0] and "continue after step" in lines[0], lines[0]
        _nothing_left(two_hosts, tmp_path, t0, 30, sessions=False)
        print(f"link down: `hetero run` ended {took:.1f} s later ({lines[0]}); nothing of the run left on either host "
              f"{time.monotonic() - t0:.1f} s after the link went down")
    finally:
        subprocess.run(["ip", "-n", link.ns[1], "link", "set", link.veth[1], "up"], timeout=10)
