"""Who can talk to a stage: keys at the ZeroMQ handshake, the authenticated sender, the plan's rules.

Each test stands up real Transports on loopback with a 3-stage tiny plan's keys and rules and plays a
hostile or faulty peer against one stage: nothing it sends may reach the stage's receive, and the
stage must keep serving its real peers afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from metrics_rows import read_metrics, step_lines
from plans import make_plan
from reference import assert_close_to_scale, reference_run
from runs import FORGER, forgers

from hetero import cli
from hetero.errors import ConfigError, PlanError, WireError
from hetero.plan import Plan
from hetero.protocol import Clip, Rebalance, Record, Stop
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.runtime.wire.frames import Message, encode
from hetero.runtime.wire.rules import coordinator_rules, max_message_bytes, stage_rules
from hetero.runtime.wire.transport import Transport
from hetero.security import (
    COORDINATOR,
    Identity,
    default_mode,
    generate,
    install_keys,
    key_dirs,
    load_identity,
    peer_token,
    resolve_mode,
    token_verifier,
)
from hetero.specs import ModelSpec, TrainSpec

SEQ_LEN = 32

M = 4  # micro-batches per step


def keyed_plan(tmp_path: Path, model_dir: Path, spec: ModelSpec, mode: str) -> Plan:
    # Hand-made activations carry only "h": rows of one record (packed plans' acts also carry "pos").
    plan = make_plan(model_dir, spec.architecture, [2, 2, 2],
                     train=TrainSpec(micro_batch_size=1, num_micro_batches=M, steps=2), packing=False)
    plan = replace(plan, security=generate(mode, [s.host for s in plan.stages], tmp_path))  # type: ignore[arg-type]
    plan.save(tmp_path / "plan.json")
    return Plan.load(tmp_path / "plan.json")


def ident(plan: Plan, tmp_path: Path, name: str) -> Identity | None:
    return load_identity(plan.security, name, key_dirs(tmp_path / "plan.json", plan.stages[0].host))


def transport(plan: Plan, tmp_path: Path, name: str, *, bind: bool, rules: bool = True) -> Transport:
    k = None if name == "coordinator" else int(name[len("stage"):])
    endpoint = ("tcp://127.0.0.1:0" if bind else None)
    r = (coordinator_rules(plan) if k is None else stage_rules(plan, k)) if rules else None
    return Transport(name, endpoint, plan.input_hash, recv_timeout_s=5, identity=ident(plan, tmp_path, name),
                     peer_keys=plan.security.public_keys, rules=r,
                     max_message_bytes=max_message_bytes(plan, k) if bind else None)


def no_linger(t: Transport) -> Transport:
    """A refused peer's queued messages are never taken: let close() drop them at once."""
    t.set_linger(0)
    return t


def refused_send(t: Transport, peer: str, tensors: dict[str, torch.Tensor]) -> None:
    """Send as a peer the handshake refuses. Either outcome is a refusal: the message queues and is never
    taken, or, where ZeroMQ's I/O thread failed the handshake before this send (it then drops the
    connection's queue), the send itself says the handshake failed."""
    try:
        t.send(peer, "act", step=0, mb=0, tensors=tensors)
    except WireError as e:
        assert "the handshake failed" in str(e)


def act(plan: Plan, value: float = 0.5, step: int = 0) -> torch.Tensor:
    return torch.full((1, plan.model.seq_len, plan.graph.hidden_size), value)


@pytest.fixture(params=["curve", "token"])
def keyed(request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: Path, tiny_spec: ModelSpec):
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, request.param)
    stage1 = transport(plan, tmp_path, "stage1", bind=True)
    stage0 = transport(plan, tmp_path, "stage0", bind=False)
    stage0.connect("stage1", stage1.endpoint)
    try:
        yield plan, stage1, stage0
    finally:
        stage0.close()
        stage1.close()


def delivered_and_still_serving(plan: Plan, stage1: Transport, stage0: Transport, value: float) -> None:
    """The real previous stage's activation still arrives, intact, after whatever was tried."""
    stage0.send("stage1", "act", step=0, mb=1, tensors={"h": act(plan, value)})
    msg = stage1.recv("act", step=0, mb=1, sender="stage0")
    assert float(msg.tensors["h"][0, 0, 0]) == value


def test_a_received_message_keeps_the_record_its_rules_checked(keyed) -> None:
    """Receivers read the typed record of a message (runtime/wire/frames.py record_of), not its raw meta."""
    from hetero.protocol import Act
    from hetero.runtime.wire.frames import record_of

    plan, stage1, stage0 = keyed
    stage0.send("stage1", Act(sent=123.5), step=0, mb=0, tensors={"h": act(plan)})
    msg = stage1.recv("act", step=0, mb=0, sender="stage0")
    assert isinstance(msg.record, Act) and msg.record.sent == 123.5 and record_of(msg, Act) is msg.record
    with pytest.raises(WireError, match="lacks meta field 'coef'"):
        from hetero.protocol import Clip

        record_of(msg, Clip)  # the meta is no clip: said in one line, as a bad message is


def test_a_client_without_the_key_delivers_nothing(keyed) -> None:
    plan, stage1, stage0 = keyed
    with Transport("stage0", None, plan.input_hash) as stranger:  # knows the address and plan hash, no key
        stranger.connect("stage1", stage1.endpoint)
        refused_send(stranger, "stage1", {"h": act(plan, float("nan"))})
        with pytest.raises(WireError, match="no 'act'"):
            stage1.recv("act", timeout_s=1.0)
        no_linger(stranger)
    assert stage1._gate is not None and stage1._gate.refused >= 1
    assert stage1.rejected == 0  # refused at the handshake: never decoded
    delivered_and_still_serving(plan, stage1, stage0, 2.0)


def test_a_stolen_plan_json_without_the_secret_key_is_refused(tmp_path: Path, tiny_model_dir: Path,
                                                               tiny_spec: ModelSpec) -> None:
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, "curve")
    with transport(plan, tmp_path, "stage1", bind=True) as stage1:
        # The thief has plan.json (every public key) and makes a keypair of its own, or reuses a public key.
        pub, sec = zmq.curve_keypair()
        for public in (pub.decode(), plan.security.public_keys["stage0"]):
            thief = Identity(name="stage0", mode="curve", public=public, secret=sec.decode())
            with Transport("stage0", None, plan.input_hash, identity=thief, peer_keys=plan.security.public_keys) as t:
                t.connect("stage1", stage1.endpoint)
                refused_send(t, "stage1", {"h": act(plan)})
                with pytest.raises(WireError, match="no 'act'"):
                    stage1.recv("act", timeout_s=1.0)
                no_linger(t)
        assert stage1._gate is not None and stage1._gate.refused >= 1


def test_a_keyed_peer_cannot_claim_another_name(keyed) -> None:
    plan, stage1, stage0 = keyed
    # stage2 has its own valid key, and claims to be stage0 to feed NaN activations.
    with transport(plan, tmp_path_of(plan), "stage2", bind=False, rules=False) as stage2:
        stage2.name = "stage0"  # the header says stage0; the handshake says stage2
        stage2.connect("stage1", stage1.endpoint)
        stage2.send("stage1", "act", step=0, mb=0, tensors={"h": act(plan, float("nan"))})
        with pytest.raises(WireError, match="no 'act'"):
            stage1.recv("act", timeout_s=1.0)
    assert "authenticated as 'stage2', not 'stage0'" in (stage1.last_rejection() or "")
    delivered_and_still_serving(plan, stage1, stage0, 3.0)


def tmp_path_of(plan: Plan) -> Path:
    return Path(os.environ["HETERO_TEST_PLAN_DIR"])


@pytest.fixture(autouse=True)
def _plan_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETERO_TEST_PLAN_DIR", str(tmp_path))


@pytest.mark.parametrize("case", ["nan", "shape", "dtype", "sender", "future_step", "mb", "duplicate", "meta"])
def test_the_plans_rules_drop_what_the_program_cannot_send(keyed, case: str) -> None:
    plan, stage1, stage0 = keyed
    stage1.rules.step = 0
    bad = {
        "nan": dict(kind="act", tensors={"h": act(plan, float("nan"))}),
        "shape": dict(kind="act", tensors={"h": torch.zeros(1, 3, plan.graph.hidden_size)}),
        "dtype": dict(kind="act", tensors={"h": act(plan).to(torch.float16)}),
        "sender": dict(kind="clip", meta={"coef": 1.0, "grad_norm": 1.0}),  # clip only from the coordinator
        "future_step": dict(kind="act", step=7, tensors={"h": act(plan)}),
        "mb": dict(kind="act", mb=M, tensors={"h": act(plan)}),
        "duplicate": dict(kind="act", tensors={"h": act(plan)}),
        "meta": dict(kind="act", tensors={"h": act(plan)}, meta={"x": 1}),
    }[case]
    kind = bad.pop("kind")
    bad.setdefault("step", 0)
    bad.setdefault("mb", 0)
    if case == "duplicate":
        stage0.send("stage1", "act", step=0, mb=0, tensors={"h": act(plan)})
    stage0.send("stage1", kind, **bad)
    # One connection delivers in order: by the time the good activation after it is read, the bad message was read
    # and dropped (no second wait of a timeout: 16 cases x 1 s).
    delivered_and_still_serving(plan, stage1, stage0, 4.0)
    assert stage1.rejected == 1, stage1.rejections
    assert stage1.pending() == (1 if case == "duplicate" else 0)  # the first act of mb 0 only: nothing else kept


def test_garbage_and_pickles_never_reach_a_keyed_stage(keyed) -> None:
    plan, stage1, stage0 = keyed
    host, port = stage1.endpoint.removeprefix("tcp://").rsplit(":", 1)
    for payload in (os.urandom(64 << 10), pickle.dumps({"evil": print})):
        with socket.create_connection((host, int(port)), timeout=5) as s:  # no ZeroMQ handshake at all
            try:
                s.sendall(payload)
            except OSError:
                pass  # ZeroMQ may hang up mid-send: that is the point
    with pytest.raises(WireError, match="no 'act'"):
        stage1.recv("act", timeout_s=1.0)
    assert stage1.rejected == 0
    delivered_and_still_serving(plan, stage1, stage0, 5.0)


FLOOD = """
import sys, torch
from hetero.plan import Plan
from hetero.runtime.wire.transport import Transport
from hetero.security import key_dirs, load_identity
plan = Plan.load(sys.argv[1]); endpoint = sys.argv[2]; mode = sys.argv[3]
ident = load_identity(plan.security, "stage0", key_dirs(sys.argv[1], plan.stages[0].host))
with Transport("stage0", None, plan.input_hash, identity=ident, peer_keys=plan.security.public_keys) as t:
    t.connect("stage1", endpoint)
    hidden = plan.graph.hidden_size
    for i in range(5):
        if mode == "oversized":  # 200 MB, one message, valid header
            t.send("stage1", "act", step=0, mb=0, tensors={"h": torch.zeros(50 << 20)})
        else:  # well-formed activations for steps the program will not reach for a long time
            for mb in range(4):
                t.send("stage1", "act", step=100 + i, mb=mb, tensors={"h": torch.zeros(1, plan.model.seq_len, hidden)})
"""


@pytest.mark.parametrize("mode", ["oversized", "future"])
def test_floods_are_dropped_and_memory_stays_bounded(keyed, mode: str) -> None:
    plan, stage1, stage0 = keyed
    stage1.rules.step = 0
    rss0 = psutil.Process().memory_info().rss
    plan_json = tmp_path_of(plan) / "plan.json"
    subprocess.run([sys.executable, "-c", FLOOD, str(plan_json), stage1.endpoint, mode], check=True, timeout=120)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        with pytest.raises(WireError):
            stage1.recv("grad", timeout_s=0.5)
    grown = psutil.Process().memory_info().rss - rss0
    assert grown < 150 << 20, f"RSS grew {grown / 2**20:.0f} MiB"
    assert stage1.pending() == 0
    if mode == "future":
        assert stage1.rejected == 20 and "accepts 0 and 1" in (stage1.last_rejection() or "")
    delivered_and_still_serving(plan, stage1, stage0, 6.0)


def test_the_coordinator_takes_reports_only_from_the_plans_stages(tmp_path: Path, tiny_model_dir: Path,
                                                                  tiny_spec: ModelSpec) -> None:
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, "curve")
    with transport(plan, tmp_path, "coordinator", bind=True) as coord, \
            transport(plan, tmp_path, "stage2", bind=False) as stage2:
        coord.rules.step = 0
        stage2.connect("coordinator", coord.endpoint)
        stage2.send("coordinator", "gradnorm", step=0, meta={"sumsq": float("nan")})  # a NaN norm: dropped
        stage2.send("coordinator", "gradnorm", step=0, meta={"sumsq": 2.0})
        assert coord.recv("gradnorm").meta["sumsq"] == 2.0
        assert coord.rejected == 1


def test_keys_are_private_files_per_host(tmp_path: Path) -> None:
    spec = generate("curve", ["alpha", "beta", "beta"], tmp_path)
    alpha = sorted(p.name for p in (tmp_path / "artifacts" / "alpha" / "keys").iterdir())
    beta = sorted(p.name for p in (tmp_path / "artifacts" / "beta" / "keys").iterdir())
    assert alpha == ["coordinator.key", "stage0.key"] and beta == ["stage1.key", "stage2.key"]
    for f in (tmp_path / "artifacts").rglob("*.key"):
        assert f.stat().st_mode & 0o077 == 0
        assert load_identity(spec, f.stem, [f.parent]) is not None
    assert set(spec.public_keys) == {"coordinator", "stage0", "stage1", "stage2"}
    rotated = generate("curve", ["alpha", "beta", "beta"], tmp_path)
    assert rotated.public_keys["stage1"] != spec.public_keys["stage1"]
    with pytest.raises(PlanError, match="does not match plan.json's public key for stage1"):
        load_identity(spec, "stage1", [tmp_path / "artifacts" / "beta" / "keys"])
    with pytest.raises(PlanError, match="no key file stage0.key"):
        load_identity(replace(spec), "stage0", [tmp_path / "nowhere"])


def test_mode_defaults_and_token_is_refused_off_one_machine() -> None:
    assert resolve_mode("auto", ["127.0.0.1", "localhost"]) == "token"
    assert resolve_mode("auto", ["127.0.0.1", "192.168.1.20"]) == "curve"
    with pytest.raises(ConfigError, match="use security=curve"):
        resolve_mode("token", ["192.168.1.20"])
    with pytest.raises(ConfigError, match="one of auto, curve, token, none"):
        resolve_mode("tls", ["127.0.0.1"])


ATTACKER = """
import os, pickle, socket, sys, time, torch
from hetero.plan import Plan
from hetero.runtime.wire.transport import Transport
from hetero.security import key_dirs, load_identity
plan = Plan.load(sys.argv[1]); target = plan.stages[1].endpoint; stop_file, ready_file = sys.argv[2:4]
keyed = load_identity(plan.security, "stage2", key_dirs(sys.argv[1], plan.stages[2].host))  # a real key, wrong peer
shape = (plan.train.micro_batch_size, plan.model.seq_len, plan.graph.hidden_size)
host, port = target.removeprefix("tcp://").rsplit(":", 1)
with Transport("stage0", None, plan.input_hash, identity=keyed, peer_keys=plan.security.public_keys) as liar, \\
        Transport("stage0", None, plan.input_hash) as stranger:
    liar.connect("stage1", target); stranger.connect("stage1", target)
    while not os.path.exists(stop_file):
        for step in range(plan.train.steps):
            for mb in range(plan.train.num_micro_batches):
                nan = torch.full(shape, float("nan"))
                liar.send("stage1", "act", step=step, mb=mb, tensors={"h": nan})      # claims stage0, is stage2
                stranger.send("stage1", "act", step=step, mb=mb, tensors={"h": nan})  # has no key at all
        open(ready_file, "w").close()  # queued for the stage's first connection: the run may start
        try:
            with socket.create_connection((host, int(port)), timeout=2) as s:  # no ZeroMQ at all
                s.sendall(os.urandom(64 << 10) + pickle.dumps({"evil": print}))
        except OSError:
            pass
        time.sleep(0.2)
    for t in (liar, stranger):  # what the stage refused will never be taken: do not linger on it
        t.set_linger(0)
"""


def test_an_attacked_run_trains_exactly_like_an_unattacked_one(tmp_path: Path, tiny_model_dir: Path,
                                                                tiny_spec: ModelSpec) -> None:
    """CurveZMQ end to end: spoofed NaN activations from a keyed-but-wrong peer, a keyless peer and
    raw garbage hit stage 1 during a real 3-stage run; the run trains exactly like the unattacked plain
    transformers + peft reference (losses and every LoRA tensor)."""
    train = TrainSpec(micro_batch_size=1, num_micro_batches=4, steps=3)
    reference = reference_run(tiny_model_dir, tmp_path / "reference", train, SEQ_LEN)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=train, lora=reference["lora"],
                     seq_len=SEQ_LEN)
    plan = replace(plan, security=generate("curve", [s.host for s in plan.stages], tmp_path))
    plan.save(tmp_path / "plan.json")
    from procs import run_hetero

    def run(name: str) -> list[float]:
        done = run_hetero(["run", "plan.json", "--no-progress", "--run-dir", name], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        return [line["loss"] for line in step_lines(read_metrics(tmp_path / name / "metrics.jsonl"))]

    stop_file, ready_file = tmp_path / "stop-attacking", tmp_path / "attacking"
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(tmp_path / "plan.json"), str(stop_file),
                                 str(ready_file)])
    try:  # a warm run takes under a second: it must not be over before the attacker has imported torch
        for _ in range(600):
            if ready_file.exists() or attacker.poll() is not None:
                break
            time.sleep(0.1)
        assert ready_file.exists(), f"the attacker did not start (exit {attacker.poll()})"
        attacked = run("attacked")
    finally:
        stop_file.write_text("")
        try:
            attacker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            attacker.kill()
    assert attacked == pytest.approx(reference["losses"], rel=1e-4) and all(math.isfinite(x) for x in attacked)
    adapter = load_adapter_state(tmp_path / "attacked" / "adapter")
    assert adapter.keys() == reference["state"].keys()
    for key, want in reference["state"].items():
        assert_close_to_scale(key, adapter[key], want, 1e-4)
    log = (tmp_path / "attacked" / "logs" / "stage1.log").read_text()
    assert "authenticated as 'stage2', not 'stage0'" in log  # the keyed liar: dropped after decoding
    assert "refused a connection" in log  # the keyless peer and the raw bytes: refused at the handshake


# -- per-process identity: a stage's key speaks for that stage only, in every mode ---------------------------


def only_from_the_coordinator(plan: Plan, kind: str, genuine: bool) -> Record:
    """A well-formed ``kind`` message that only the coordinator may send a stage (forged ones differ in meta)."""
    tag = "genuine" if genuine else "forged"
    if kind == "stop":
        return Stop(reason=tag)
    if kind == "checkpoint":  # the coordinator's "send me your checkpoint after step N"
        return Stop(reason=tag, checkpoint=1)
    if kind == "clip":
        return Clip(coef=1.0 if genuine else 0.0, grad_norm=1.0)
    return Rebalance(spans=[[s.first_node, s.last_node] for s in plan.stages], recompute=[[] for _ in plan.stages],
                     reason=tag)


def forged_logins(plan: Plan, tmp_path: Path, mode: str, claimed: str, target: str) -> list[dict[str, bytes]]:
    """Every way stage1's key file could try to log in at ``target`` as ``claimed``: ZeroMQ socket options."""
    mine = ident(plan, tmp_path, "stage1")
    victim = ident(plan, tmp_path, claimed)
    assert mine is not None and victim is not None
    if mode == "curve":  # the victim's public key (from plan.json) with stage1's secret
        return [{"curve_publickey": victim.public.encode(), "curve_secretkey": mine.secret.encode(),
                 "curve_serverkey": plan.security.public_keys[target].encode()}]
    # Every string in stage1's key file (before per-process tokens: every process's token), stage1's own
    # password at the target, and what stage1's inbox saw the victim present there.
    key_file = tmp_path / "artifacts" / plan.stages[1].host / "keys" / "stage1.key"
    held = json.loads(key_file.read_text())
    held = [v for value in held.values() for v in (value.values() if isinstance(value, dict) else [value])]
    harvested = peer_token(victim.token, "stage1")
    return [{"plain_username": claimed.encode(), "plain_password": password.encode()}
            for password in (*held, mine.token_for(target), harvested)]


def nothing_delivered_until(receiver: Transport, kind: str, done: Callable[[], bool]) -> None:
    """Read (and drop) what arrives until ``done()``; a ``kind`` message reaching recv fails the test."""
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, (receiver.rejections, receiver._gate and receiver._gate.refused)
        try:
            msg = receiver.recv(kind, timeout_s=0.2)
        except WireError:
            continue
        raise AssertionError(f"a forgery reached recv: {msg.describe()} {msg.meta}")


def transport_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hetero.runtime.wire.transport"]


def refused_with_the_peer(logs: list[str], receiver: str, mode: str) -> None:
    """The forged logins were logged as refusals; in token mode (refused by ZAP) with the forger's address.

    A CURVE login with another process's public key fails the handshake's cryptography before ZAP is
    asked, and libzmq's monitor events (without its draft API) carry no peer address for it."""
    refusals = [line for line in logs if f"{receiver} refused a connection" in line]
    assert refusals, logs
    if mode == "token":
        assert all(FORGER in line for line in refusals), refusals  # (IPv4-mapped: ::ffff:127.0.0.2)


@pytest.mark.parametrize("kind", ["stop", "clip", "checkpoint", "rebalance"])
@pytest.mark.parametrize("mode", ["token", "curve"])
def test_a_stage_key_cannot_send_what_only_the_coordinator_sends(
        tmp_path: Path, tiny_model_dir: Path, tiny_spec: ModelSpec, caplog: pytest.LogCaptureFixture,
        mode: str, kind: str) -> None:
    """stage1's key tries a coordinator-only message on stage0 three ways: logged in as the coordinator
    (refused at the handshake), as stage1 with a header saying coordinator, and as itself (both dropped).
    Each is logged with the peer; stage0 then takes the real coordinator's message."""
    caplog.set_level(logging.WARNING, logger="hetero.runtime.wire.transport")
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, mode)
    forged = only_from_the_coordinator(plan, kind, genuine=False)
    wire_kind = forged.KIND
    with transport(plan, tmp_path, "stage0", bind=True) as stage0, \
            transport(plan, tmp_path, "stage1", bind=False, rules=False) as liar, \
            transport(plan, tmp_path, "stage1", bind=False, rules=False) as stage1, \
            transport(plan, tmp_path, "coordinator", bind=False) as coordinator:
        assert stage0.endpoint is not None and stage0._gate is not None and stage0.rules is not None
        stage0.rules.step = 0
        frames = encode(Message(kind=wire_kind, sender=COORDINATOR, step=0, mb=-1, meta=forged.to_wire()),
                        plan.input_hash)
        logins = forged_logins(plan, tmp_path, mode, COORDINATOR, "stage0")
        with forgers(stage0.endpoint, logins, frames):  # (a)
            liar.name = COORDINATOR  # (b) the handshake says stage1, the header says coordinator
            for t in (liar, stage1):  # (c) stage1 as itself
                t.connect("stage0", stage0.endpoint)
                t.send("stage0", forged, step=0)
            nothing_delivered_until(stage0, wire_kind,
                                    lambda: stage0.rejected >= 2 and stage0._gate.refused >= len(logins))  # type: ignore[union-attr]
        assert stage0.rejected == 2, stage0.rejections
        coordinator.connect("stage0", stage0.endpoint)
        genuine = only_from_the_coordinator(plan, kind, genuine=True)
        coordinator.send("stage0", genuine, step=0)
        msg = stage0.recv(wire_kind, timeout_s=30)
        assert (msg.sender, msg.meta) == (COORDINATOR, genuine.to_wire())
    logs = transport_logs(caplog)
    refused_with_the_peer(logs, "stage0", mode)
    assert any(f"dropped a message from stage1: {forged.KIND!r}" in line and "authenticated as 'stage1', "
               "not 'coordinator'" in line for line in logs), logs
    assert any(f"dropped a message from stage1: {forged.KIND!r}" in line and
               f"takes {forged.KIND!r} only from coordinator" in line for line in logs), logs


@pytest.mark.parametrize("mode", ["token", "curve"])
def test_a_stage_key_cannot_send_another_stages_checkpoint(
        tmp_path: Path, tiny_model_dir: Path, tiny_spec: ModelSpec, caplog: pytest.LogCaptureFixture,
        mode: str) -> None:
    """stage1's key tries to hand the coordinator a checkpoint of stage0's (zeroed LoRA state): refused as
    stage0 at the handshake, dropped as stage1 claiming stage0; stage0's real checkpoint arrives."""
    caplog.set_level(logging.WARNING, logger="hetero.runtime.wire.transport")
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, mode)
    state = {"lora_A": torch.zeros(4, 4)}
    with transport(plan, tmp_path, "coordinator", bind=True) as coordinator, \
            transport(plan, tmp_path, "stage1", bind=False, rules=False) as liar, \
            transport(plan, tmp_path, "stage0", bind=False) as stage0:
        assert coordinator.endpoint is not None and coordinator._gate is not None
        frames = encode(Message(kind="checkpoint", sender="stage0", step=0, mb=-1, meta={},
                                tensors=state), plan.input_hash)
        logins = forged_logins(plan, tmp_path, mode, "stage0", COORDINATOR)
        with forgers(coordinator.endpoint, logins, frames):
            liar.name = "stage0"
            liar.connect(COORDINATOR, coordinator.endpoint)
            liar.send(COORDINATOR, "checkpoint", step=0, tensors=state)
            nothing_delivered_until(coordinator, "checkpoint",
                                    lambda: coordinator.rejected >= 1 and coordinator._gate.refused >= len(logins))  # type: ignore[union-attr]
        assert coordinator.rejected == 1, coordinator.rejections
        stage0.connect(COORDINATOR, coordinator.endpoint)
        stage0.send(COORDINATOR, "checkpoint", step=0, tensors={"lora_A": torch.ones(4, 4)})
        msg = coordinator.recv("checkpoint", timeout_s=30)
        assert msg.sender == "stage0" and torch.equal(msg.tensors["lora_A"], torch.ones(4, 4))
    logs = transport_logs(caplog)
    refused_with_the_peer(logs, "coordinator", mode)
    assert any("dropped a message from stage1: 'checkpoint'" in line and
               "authenticated as 'stage1', not 'stage0'" in line for line in logs), logs


def test_a_token_key_file_holds_its_own_secret_only(tmp_path: Path) -> None:
    """No key file nor plan.json holds a password that logs in as another process; each inbox admits every
    process's own password and nothing else."""
    spec = generate("token", ["alpha", "beta", "beta"], tmp_path)
    files = {f.stem: f for f in (tmp_path / "artifacts").rglob("*.key")}
    assert set(files) == {"coordinator", "stage0", "stage1", "stage2"}
    own = {name: json.loads(f.read_text()) for name, f in files.items()}
    assert all(set(data) == {"identity", "mode", "token"} for data in own.values()), own
    section = json.dumps(dataclasses.asdict(spec))
    for name, data in own.items():
        assert data["token"] not in section
        for other in set(files) - {name}:
            assert data["token"] not in files[other].read_text()
            assert peer_token(data["token"], other) not in files[other].read_text() + section
    for server in files:
        me = load_identity(spec, server, [files[server].parent])
        assert me is not None and dict(me.verifiers) == spec.token_verifiers[server]
        for client, data in own.items():
            assert spec.token_verifiers[server][client] == token_verifier(peer_token(data["token"], server))
            # what the server saw from this client opens no other inbox
            for elsewhere in set(files) - {server}:
                assert spec.token_verifiers[elsewhere][client] != token_verifier(peer_token(data["token"], server))


def test_a_token_plan_from_before_per_process_tokens_says_to_run_keys(tmp_path: Path, tiny_model_dir: Path,
                                                                     tiny_spec: ModelSpec) -> None:
    """plan.json without verifiers and key files holding every token (the old format): it loads, and
    running it is one line saying to run `hetero keys`, which makes a working plan again."""
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, "token")
    folder = tmp_path / "artifacts" / plan.stages[0].host / "keys"
    tokens = {f.stem: json.loads(f.read_text())["token"] for f in folder.glob("*.key")}
    for name, token in tokens.items():  # what generate() wrote before this change
        (folder / f"{name}.key").write_text(json.dumps({"identity": name, "mode": "token", "token": token,
                                                         "peer_tokens": tokens}))
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["security"]["token_verifiers"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "plan.json")  # still loads (show, simulate): only running it needs new keys
    assert old.input_hash == plan.input_hash
    for name in ("coordinator", "stage1"):
        with pytest.raises(PlanError, match=r"run `hetero keys plan.json`") as err:
            ident(old, tmp_path, name)
        assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match=r"holds every process's token .* run `hetero keys plan.json`"):
        ident(plan, tmp_path, "stage1")  # a new plan.json beside an old key file
    assert cli.main(["keys", str(tmp_path / "plan.json")]) == 0
    new = Plan.load(tmp_path / "plan.json")
    assert new.input_hash == plan.input_hash and new.security.token_verifiers
    assert ident(new, tmp_path, "stage1") is not None


def test_keys_are_made_private_again_on_every_write(tmp_path: Path, tiny_model_dir: Path,
                                                    tiny_spec: ModelSpec) -> None:
    """A key file left 0644 by hand (or a copy) is 0600 after `hetero keys` and after install_keys; folders 0700."""
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, "curve")
    folder = tmp_path / "artifacts" / plan.stages[0].host / "keys"
    for f in folder.glob("*.key"):
        f.chmod(0o644)
    folder.chmod(0o755)
    assert cli.main(["keys", str(tmp_path / "plan.json")]) == 0
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in folder.glob("*.key")} == {0o600}
    plan = Plan.load(tmp_path / "plan.json")
    run_keys = tmp_path / "run" / "keys"
    run_keys.mkdir(parents=True)
    names = ["coordinator", "stage0", "stage1"]
    for name in names:  # a run dir used before, its keys since copied world-readable
        shutil.copy(folder / f"{name}.key", run_keys / f"{name}.key")
        (run_keys / f"{name}.key").chmod(0o644)
    run_keys.chmod(0o755)
    install_keys(plan.security, names[:2], [folder], run_keys)  # rewritten from the plan's folder
    install_keys(plan.security, names[2:], [run_keys], run_keys)  # already in place
    assert stat.S_IMODE(run_keys.stat().st_mode) == 0o700
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in run_keys.iterdir()} == {
        f"{name}.key": 0o600 for name in names}
    assert all(load_identity(plan.security, name, [run_keys]) is not None for name in names)


@pytest.mark.parametrize("removed", ["deleted", "emptied"])
def test_a_plan_that_lost_its_security_section_does_not_run_unauthenticated(
        tmp_path: Path, tiny_model_dir: Path, tiny_spec: ModelSpec, capsys: pytest.CaptureFixture[str],
        removed: str) -> None:
    """The input hash does not cover the security section: a curve plan whose section was deleted or emptied would
    run with no authentication and no word. It is refused in one line naming the two ways on; `hetero keys`
    makes keys for it again (the fleet's default mode), and `"mode": "none"` runs it unauthenticated on purpose."""
    plan = keyed_plan(tmp_path, tiny_model_dir, tiny_spec, "curve")
    path = tmp_path / "plan.json"
    data = json.loads(path.read_text())
    if removed == "deleted":
        del data["security"]
    else:
        data["security"] = {}
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        Plan.load(path)
    assert str(err.value) == (
        f"{path}: no 'security' section with a mode (removed by hand?): its processes would accept anyone; make keys "
        f"with `hetero keys {path}` (and copy them to every host), or write \"security\": {{\"mode\": \"none\"}} into "
        "it to run without authentication on purpose")
    capsys.readouterr()
    assert cli.main(["run", str(path), "--no-progress"]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line, before anything starts
    assert cli.main(["keys", str(path)]) == 0
    repaired = Plan.load(path)
    assert repaired.security.mode == default_mode([h.address for h in plan.cluster.hosts])
    assert repaired.input_hash == plan.input_hash and ident(repaired, tmp_path, "stage1") is not None
    data["security"] = {"mode": "none"}
    path.write_text(json.dumps(data))
    assert Plan.load(path).security.mode == "none"  # said outright: allowed


def test_each_host_needs_only_its_own_folder_and_another_hosts_is_refused(tmp_path: Path, tiny_model_dir: Path,
                                                                          tiny_spec: ModelSpec) -> None:
    """What `hetero show --hosts` says to copy to a host (plan.json and artifacts/<host>/, its keys only) is enough
    for its check; a box handed another host's folder is refused in one line before any stage starts (issue 53)."""
    import shutil

    from hetero.cli.hosts_view import host_lines
    from hetero.runtime.run.box_check import box_problems

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], hosts=["alpha", "beta", "beta"])
    compiled = tmp_path / "out"
    plan = replace(plan, security=generate("curve", [s.host for s in plan.stages], compiled))
    plan.save(compiled / "plan.json")
    plan = Plan.load(compiled / "plan.json")
    lines = host_lines(plan, compiled / "plan.json")
    beta = lines[lines.index(next(ln for ln in lines if ln.startswith("host beta"))):]
    copy = next(ln for ln in beta if ln.startswith("  copy: "))
    assert f"{compiled / 'artifacts' / 'beta'}/ (this host's keys only)" in copy and "alpha" not in copy, copy
    ports = next(ln for ln in beta if ln.startswith("  open ports: "))
    assert ports.startswith(f"  open ports: {plan.stages[1].endpoint.rsplit(':', 1)[1]}, "
                            f"{plan.stages[2].endpoint.rsplit(':', 1)[1]} (TCP"), ports
    for box, folder in (("good", "beta"), ("wrong", "alpha")):
        there = tmp_path / box
        (there / "artifacts").mkdir(parents=True)
        shutil.copy(compiled / "plan.json", there / "plan.json")
        shutil.copytree(compiled / "artifacts" / folder, there / "artifacts" / folder)
        said = [p for p in box_problems(there / "plan.json", plan, "beta") if "port" not in p]
        if box == "good":
            assert said == [], said
        else:
            assert len(said) == 1 and "no key file stage1.key" in said[0], said
