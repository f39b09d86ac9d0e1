"""Who can talk to a stage: keys at the ZeroMQ handshake, the authenticated sender, the plan's rules.

Each test stands up real Transports on loopback with a 3-stage tiny plan's keys and rules and plays a
hostile or faulty peer against one stage: nothing it sends may reach the stage's receive, and the
stage must keep serving its real peers afterwards.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from reference import assert_close_to_scale, reference_run
from test_runtime_plans import make_plan

from hetero.errors import ConfigError, PlanError, WireError
from hetero.plan import Plan
from hetero.runtime.run.adapter import load_adapter_state
from hetero.runtime.tools.run_compare import read_metrics, step_lines
from hetero.runtime.wire.rules import coordinator_rules, max_message_bytes, stage_rules
from hetero.runtime.wire.transport import Transport
from hetero.security import Identity, generate, key_dirs, load_identity, resolve_mode
from hetero.specs import ModelSpec, TrainSpec

SEQ_LEN = 32

M = 4  # micro-batches per step


def keyed_plan(tmp_path: Path, model_dir: Path, spec: ModelSpec, mode: str) -> Plan:
    plan = make_plan(model_dir, spec.architecture, [2, 2, 2],
                     train=TrainSpec(micro_batch_size=1, num_micro_batches=M, steps=2))
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


def test_a_client_without_the_key_delivers_nothing(keyed) -> None:
    plan, stage1, stage0 = keyed
    with Transport("stage0", None, plan.input_hash) as stranger:  # knows the address and plan hash, no key
        stranger.connect("stage1", stage1.endpoint)
        stranger.send("stage1", "act", step=0, mb=0, tensors={"h": act(plan, float("nan"))})
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
                t.send("stage1", "act", step=0, mb=0, tensors={"h": act(plan)})
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
    with pytest.raises(WireError, match="no 'grad'"):
        stage1.recv("grad", timeout_s=1.0)  # reads (and keeps or drops) everything that arrived
    assert stage1.rejected == 1, stage1.rejections
    delivered_and_still_serving(plan, stage1, stage0, 4.0)


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
plan = Plan.load(sys.argv[1]); target = plan.stages[1].endpoint; stop_file = sys.argv[2]
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
    hetero = [sys.executable, "-m", "hetero.cli", "run", "plan.json", "--no-progress"]

    def run(name: str) -> list[float]:
        done = subprocess.run([*hetero, "--run-dir", name], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return [line["loss"] for line in step_lines(read_metrics(tmp_path / name / "metrics.jsonl"))]

    stop_file = tmp_path / "stop-attacking"
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(tmp_path / "plan.json"), str(stop_file)])
    try:
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
