"""hetero/protocol.py: one record per message kind, round trips, one-line refusals, and a source scan
proving that nothing in runtime/ or bench/ sends a kind the protocol does not define."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hetero import protocol
from hetero.errors import WireError
from hetero.protocol import (
    KINDS,
    RECORDS,
    Clip,
    GradNorm,
    Hello,
    StepDone,
    Stop,
    record_type,
)
from hetero.runtime.wire.frames import Message, decode, encode
from hetero.runtime.wire.rules import check_meta
from hetero.runtime.wire.transport import Transport

ROOT = Path(__file__).resolve().parents[2]
PLAN = "0123456789abcdef0123"

# One valid meta per kind: a kind added to the protocol without a sample here fails test_every_kind_has_a_sample.
SAMPLES: dict[str, dict[str, Any]] = {
    "hello": {"stage": 1, "input_hash": PLAN, "wire_version": protocol.WIRE_VERSION, "pid": 42,
              "env": {"torch": "2.x"}, "newer_field": [1, 2]},
    "welcome": {"train": {"lr": 1e-3}, "start_step": 0, "resume": False, "failure_timeout_s": 10.0, "eval_every": 0},
    "start": {"stage": 0, "keys": ["base_model.model.x.lora_A.weight"], "build_s": 1.5, "lora_params": 64},
    "state": {"stage": 0, "step": 3},
    "stop": {"reason": "done"},
    "error": {"message": "stage 1 failed: boom", "stage": 1},
    "heartbeat": {},
    "batch": {},
    "labels": {"num_label_tokens": 17},
    "act": {},
    "grad": {},
    "gradnorm": {"sumsq": 2.5},
    "clip": {"coef": 0.5, "grad_norm": 4.0},
    "grads": {},
    "reduced": {"coef": 1.0, "grad_norm": 0.0},
    "stepdone": {"step": 3, "loss_sum": 12.5, "num_label_tokens": 17, "grad_sumsq": 0.25, "lr": 1e-3,
                 "busy_s": 0.1, "wall_s": 0.2, "op_time_s": {"F": 0.05, "B": 0.05}},
    "checkpoint": {"stage": 0, "step": 4},
    "rebalance": {"spans": [[0, 2], [3, 10]], "recompute": [[], ["model.layers.5"]],
                  "reason": "stage 0 (box.gpu0) runs 3.20x slower than when its split was planned"},
    "snapshot": {},
    "evaldone": {"loss_sum": 41.5, "num_label_tokens": 12, "round": 1},
    "loss": {"loss": 1.5},
}


def test_protocol_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "import hetero.protocol, hetero.program\n"
            "print(len(hetero.protocol.RECORDS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(RECORDS)


def test_every_kind_has_a_sample_and_one_record() -> None:
    assert set(SAMPLES) == set(KINDS) == set(RECORDS)
    assert all(RECORDS[kind].KIND == kind for kind in KINDS)
    assert protocol.UNSTEPPED == {"hello", "welcome", "start", "state", "stop", "error", "heartbeat"}


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_records_round_trip_through_the_wire(kind: str) -> None:
    record = record_type(kind).from_wire(SAMPLES[kind])
    assert record.to_wire() == SAMPLES[kind]
    sent = Message(record.KIND, "stage0", step=2, meta=record.to_wire())
    got = decode(encode(sent, PLAN), PLAN)
    assert record_type(got.kind).from_wire(got.meta) == record
    assert check_meta(got) == record  # the receivers' rules validate through the same record


def test_records_are_frozen_and_typed() -> None:
    clip = Clip(coef=0.25, grad_norm=8.0)
    with pytest.raises(AttributeError):
        clip.coef = 1.0  # type: ignore[misc]
    assert clip.to_wire() == {"coef": 0.25, "grad_norm": 8.0}
    assert Stop(reason="bye").to_wire() == {"reason": "bye"}  # an optional field left unset is left out
    assert Stop(reason="ctrl-c", checkpoint=3).to_wire() == {"reason": "ctrl-c", "checkpoint": 3}
    assert Hello(stage=0, input_hash=PLAN).wire_version == protocol.WIRE_VERSION
    hello = Hello.from_wire(SAMPLES["hello"])
    assert hello.extra == {"newer_field": [1, 2]} and hello.pid == 42  # an open record keeps what it does not know


BAD: dict[str, tuple[str, dict[str, Any], str]] = {
    "missing field": ("clip", {"coef": 0.5}, "lacks meta field 'grad_norm'"),
    "bool for a number": ("clip", {"coef": True, "grad_norm": 1.0}, "meta 'coef' is a bool"),
    "string for a number": ("gradnorm", {"sumsq": "1"}, "meta 'sumsq' is a str"),
    "NaN": ("gradnorm", {"sumsq": float("nan")}, "meta 'sumsq' is nan, not a finite number"),
    "inf": ("clip", {"coef": float("inf"), "grad_norm": 1.0}, "not a finite number"),
    "above the range": ("clip", {"coef": 1.5, "grad_norm": 1.0}, "meta 'coef' = 1.5 is out of range"),
    "below the range": ("labels", {"num_label_tokens": 0}, "meta 'num_label_tokens' = 0 is out of range"),
    "negative stage": ("hello", {"stage": -1, "input_hash": PLAN, "wire_version": 1}, "out of range"),
    "float for an int": ("labels", {"num_label_tokens": 3.0}, "meta 'num_label_tokens' is a float"),
    "closed record, extra key": ("clip", {"coef": 1.0, "grad_norm": 1.0, "x": 1}, "unexpected meta field 'x'"),
    "tensor kind with meta": ("act", {"tokens": 3}, "unexpected meta field 'tokens'"),
    "optional field explicitly None": ("stop", {"reason": None}, "meta 'reason' is a NoneType"),
    "wrong type in an open record": ("welcome", {"train": [], "start_step": 0, "resume": False}, "meta 'train' is a list"),
    "meta not a map": ("stop", [1], "meta is a list, not a map"),  # type: ignore[dict-item]
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_meta_is_refused_with_one_line(case: str) -> None:
    kind, meta, expected = BAD[case]
    where = f"{kind!r} step 0 mb -1 from stage3"
    with pytest.raises(WireError) as err:
        record_type(kind).from_wire(meta, where)
    text = str(err.value)
    assert expected in text and text.startswith(where) and "\n" not in text
    with pytest.raises(WireError, match=expected.replace("'", ".")):  # the runtime's rules say the same
        check_meta(Message(kind, "stage3", meta=meta))  # type: ignore[arg-type]


def test_a_record_is_validated_where_it_is_made() -> None:
    with pytest.raises(WireError, match="'clip' record: meta 'coef' = 2 is out of range"):
        Clip(coef=2, grad_norm=0.0)
    with pytest.raises(WireError, match="sumsq' is nan"):
        GradNorm(sumsq=float("nan"))
    with pytest.raises(WireError, match="unexpected meta field 'x'"):
        GradNorm(sumsq=1.0, extra={"x": 1})
    with pytest.raises(WireError, match="meta 'lr' is inf"):
        StepDone(**{**SAMPLES["stepdone"], "lr": float("inf")})


def test_undefined_kinds_are_refused_everywhere() -> None:
    with pytest.raises(WireError, match="unknown message kind 'generate'"):
        record_type("generate")
    with pytest.raises(WireError, match="a run never sends this kind here"):
        check_meta(Message("generate", "stage0"))
    with Transport("stage0", None, PLAN) as t:  # refused before a peer is even looked up
        with pytest.raises(WireError, match="unknown message kind 'nope'"):
            t.send("stage1", "nope")
        with pytest.raises(WireError, match="pass no meta= with it"):
            t.send("stage1", Clip(coef=1.0, grad_norm=0.0), meta={"coef": 0.5})
        with pytest.raises(WireError, match="no connection to 'stage1'"):  # a record is a defined kind
            t.send("stage1", Clip(coef=1.0, grad_norm=0.0))


def test_transport_sends_a_record_as_its_kind_and_meta() -> None:
    with Transport("stage1", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=10.0) as rx, \
            Transport("coordinator", None, PLAN) as tx:
        assert rx.endpoint is not None
        tx.connect("stage1", rx.endpoint)
        tx.send("stage1", Clip(coef=0.5, grad_norm=3.0), step=4)
        msg = rx.recv("clip", step=4)
        assert msg.meta == {"coef": 0.5, "grad_norm": 3.0} and Clip.from_wire(msg.meta).coef == 0.5


# -- every send in runtime/ and bench/ names a kind the protocol defines ----------------------------------

RECORD_NAMES = {r.__name__ for r in RECORDS.values()}


def sends(source: str, path: str = "<source>") -> list[tuple[str, int, str]]:
    """Every ``x.send(peer, kind, ...)`` (and the coordinator's ``link.send_all(kind, ...)`` and
    ``link.broadcast(kind)``, to every stage) whose kind is a literal or a record: (where, line, kind or record)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("send", "send_all", "broadcast")):
            continue
        at = 1 if node.func.attr == "send" else 0  # send_all/broadcast: no peer, the kind first
        kind = (node.args[at] if len(node.args) > at
                else next((k.value for k in node.keywords if k.arg in ("kind", "record")), None))
        if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
            found.append((path, node.lineno, kind.value))
        elif isinstance(kind, ast.Call) and isinstance(kind.func, ast.Name) and kind.func.id[:1].isupper():
            found.append((path, node.lineno, kind.func.id + "()"))
    return found


def undefined(found: list[tuple[str, int, str]]) -> list[str]:
    """The sends whose kind (or record class) hetero/protocol.py does not define."""
    return [f"{path}:{line} sends {kind!r}" for path, line, kind in found
            if not (kind in KINDS or (kind.endswith("()") and kind[:-2] in RECORD_NAMES))]


def test_the_send_checker_finds_undefined_kinds() -> None:
    source = ("t.send('stage1', 'act', step=0, tensors={})\n"
              "mailbox.send(peer, Clip(coef=1.0, grad_norm=0.0), step=3)\n"
              "self.transport.send(COORDINATOR, 'generate', meta={})\n"
              "wire.send(peer, kind='logits')\n"
              "wire.send(peer, Bogus(x=1))\n"
              "sock.send(b'raw bytes')\n"  # a socket's send: one argument, not a message
              "t.send(peer, kind)\n"  # a variable: checked where the kind is made
              "link.send_all(Snapshot(), step=2)\n"
              "link.broadcast(Stop(reason='done'))\n")
    found = sends(source, "demo.py")
    assert [kind for _, _, kind in found] == ["act", "Clip()", "generate", "logits", "Bogus()", "Snapshot()", "Stop()"]
    assert undefined(found) == ["demo.py:3 sends 'generate'", "demo.py:4 sends 'logits'", "demo.py:5 sends 'Bogus()'"]


def test_runtime_and_bench_send_only_defined_kinds() -> None:
    found = []
    for folder in ("runtime", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += sends(path.read_text(), str(path.relative_to(ROOT)))
    assert undefined(found) == []
    kinds = {kind for _, _, kind in found}
    # The scan sees the run's traffic (so an empty scan cannot pass): tensors by name, control by record.
    assert {"act", "grad", "grads", "batch", "checkpoint"} <= kinds, kinds
    assert {"Hello()", "Start()", "Labels()", "GradNorm()", "Clip()", "Reduced()", "StepDone()", "Stop()",
            "Error()"} <= kinds, kinds

