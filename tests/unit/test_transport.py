"""Transport over real ZeroMQ sockets: in one process, across processes, and against hostile peers."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pathlib
import socket
import subprocess
import sys
import threading
import time
import tokenize

import msgpack
import pytest
import torch
import zmq
from plans import free_ports

from hetero.errors import WireError
from hetero.runtime.base.env import describe_environment
from hetero.runtime.wire.endpoints import bind_address
from hetero.runtime.wire.frames import WIRE_VERSION, Message, encode
from hetero.runtime.wire.transport import Transport

PLAN = "9f8e7d6c5b4a39281706"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "float32": torch.randn(5, 7, generator=g),
        "float16": torch.randn(3, 4, generator=g).half(),
        "bfloat16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "int64": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "int32": torch.randint(-(2**30), 2**30, (2, 2), generator=g, dtype=torch.int32),
        "uint8": torch.randint(0, 256, (9,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(4, 4, generator=g) > 0.5,
        "scalar": torch.tensor(2.75),
    }


def assert_same(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def pair():
    """Two connected transports on loopback with OS-chosen ports."""
    a = Transport("stage0", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=10)
    b = Transport("stage1", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=10)
    a.connect("stage1", b.endpoint)
    b.connect("stage0", a.endpoint)
    yield a, b
    a.close()
    b.close()


def raw_push(endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    return ctx, sock


def test_every_dtype_round_trips_in_process(pair) -> None:
    a, b = pair
    sent = sample_tensors()
    a.send("stage1", "act", step=4, mb=1, tensors=sent, meta={"tokens": 35})
    got = b.recv("act", step=4, mb=1, sender="stage0")
    assert (got.kind, got.sender, got.step, got.mb, got.meta) == ("act", "stage0", 4, 1, {"tokens": 35})
    assert_same(got.tensors, sent)


def test_recv_out_of_order_keeps_the_rest_in_arrival_order(pair) -> None:
    a, b = pair
    for mb in range(3):
        a.send("stage1", "act", step=0, mb=mb, tensors={"x": torch.full((2,), float(mb))})
    a.send("stage1", "grad", step=0, mb=0, tensors={"g": torch.ones(2)})
    # The 1F1B executor may ask for a grad that arrived after several activations.
    grad = b.recv("grad", step=0, mb=0)
    assert grad.tensors["g"].tolist() == [1.0, 1.0]
    assert b.pending() == 3
    assert b.recv("act", mb=2).tensors["x"].tolist() == [2.0, 2.0]
    assert [b.recv().mb for _ in range(2)] == [0, 1]  # unfiltered: arrival order
    assert b.pending() == 0


def test_timeout_names_what_was_awaited_and_from_whom(pair) -> None:
    _, b = pair
    start = time.monotonic()
    with pytest.raises(WireError) as err:
        b.recv("grad", step=3, mb=2, sender="stage2", timeout_s=0.3)
    assert 0.25 <= time.monotonic() - start < 3
    assert str(err.value) == ("no 'grad' step 3 mb 2 from stage2 within 0.3 s: is that stage alive? "
                              "see logs/stage2.log in its host's run directory")


def test_default_timeout_comes_from_the_constructor() -> None:
    with Transport("stage0", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=0.2) as t:
        with pytest.raises(WireError, match="within 0.2 s"):
            t.recv("loss")


def test_bad_messages_are_dropped_logged_and_never_lose_queued_good_ones(pair) -> None:
    a, b = pair
    a.send("stage1", "act", step=1, mb=0, tensors={"x": torch.arange(4.0)})
    a.send("stage1", "heartbeat")
    b.recv("heartbeat")  # one pipe is FIFO: the good 'act' now waits in b's queue
    assert b.pending() == 1
    ctx, sock = raw_push(b.endpoint)
    good_header = {"v": WIRE_VERSION, "plan": PLAN, "kind": "act", "sender": "evil", "step": 1, "mb": 1,
                   "meta": {}, "tensors": [{"name": "x", "dtype": "float32", "shape": [4]}]}
    bad = [
        ([b"\x92\x01"], "not valid msgpack"),
        ([msgpack.packb({**good_header, "v": WIRE_VERSION + 1}), b"\0" * 16], "wire version"),
        ([msgpack.packb({**good_header, "plan": "0" * 20}), b"\0" * 16], "runs plan 000000000000"),
        ([msgpack.packb({**good_header, "kind": "shell"}), b"\0" * 16], "unknown kind 'shell'"),
        ([msgpack.packb({**good_header, "step": "1"}), b"\0" * 16], "'step' must be an integer"),
        ([msgpack.packb(good_header), b"\0" * 15], "needs 16 bytes, its frame has 15"),
        ([msgpack.packb({**good_header, "tensors": [{"name": "x", "dtype": "complex64", "shape": [2]}]}),
          b"\0" * 16], "unknown dtype 'complex64'"),
    ]
    try:
        for frames, _ in bad:
            sock.send_multipart(frames)
        with pytest.raises(WireError, match="no 'grad'"):
            b.recv("grad", timeout_s=1.0)  # every bad message is read, dropped, and the wait goes on
        assert b.rejected == len(bad)
        for (_, expected), (peer, why) in zip(bad, b.rejections, strict=True):
            assert expected in why and peer.startswith("unauthenticated peer")
        assert b.pending() == 1
        assert b.recv("act", mb=0).tensors["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        # A well-formed message from the same raw socket still gets through afterwards.
        sock.send_multipart([msgpack.packb(good_header), torch.arange(4.0).numpy().tobytes()])
        assert b.recv("act", mb=1, sender="evil").tensors["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        a.send("stage1", "loss", step=1, meta={"loss": 1.5})
        assert b.recv("loss").meta == {"loss": 1.5}
    finally:
        sock.close()
        ctx.term()


def test_a_lost_stage_of_an_earlier_plan_is_logged_as_coming_back(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 53: a host taken back after a loss printed "every host must run the same plan.json ... restart" while it
    rejoined. A coordinator's inbox that knows the run's earlier plans logs the hello of a stage the run lost, under
    one of them, as a device coming back (still kept as a rejection: the rejoin reads it there); a stage the run still
    has, under an earlier plan, sent it before the run's last switch (a message late by a few milliseconds once
    warned "every host must run the same plan.json" in a rejoin); a plan the run never had is warned about as before."""
    caplog.set_level(logging.INFO, logger="hetero.runtime.wire.transport")
    earlier = "1a2b3c4d5e6f7081"  # a plan hash (16 hex digits, as plan.json has it)
    with Transport("coordinator", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=10) as coordinator:
        coordinator.inbox.returning = ({earlier}, {"stage0", "stage2"})
        for sender, plan in (("stage1", earlier), ("stage2", earlier), ("stage1", "0" * 20)):
            with Transport(sender, None, plan) as stage:
                stage.connect("coordinator", coordinator.endpoint)
                stage.send("coordinator", "hello", meta={"stage": 1})
                for _ in range(3 if plan == earlier and sender == "stage1" else 0):  # its heartbeats: said once
                    stage.send("coordinator", "heartbeat")
        with pytest.raises(WireError, match="no 'loss'"):
            coordinator.recv("loss", timeout_s=1.5)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "stage" in r.getMessage()]
    assert said[0] == (logging.INFO, f"coordinator: stage1 says hello under plan {earlier}, an earlier plan of "
                       "this run: a lost device coming back (taken back at a step boundary where that is faster)")
    assert said[1] == (logging.INFO, f"coordinator: stage2's messages under plan {earlier}, an earlier plan of this "
                       "run, sent before the run went on under this one, are dropped")
    assert [level for level, _ in said[2:]] == [logging.WARNING], said
    assert "every host must run the same plan.json" in said[2][1] and "peer stage1 runs plan 00000000" in said[2][1]
    assert len(coordinator.rejections) == coordinator.rejected == 6  # all are kept (and counted) for the rejoin check


def test_large_tensor_arrives_intact(pair) -> None:
    a, b = pair
    big = torch.randn(16 << 20, generator=torch.Generator().manual_seed(1))  # 64 MiB of float32
    a.send("stage1", "act", mb=0, tensors={"h": big})
    got = b.recv("act", mb=0).tensors["h"]
    assert got.shape == big.shape and torch.equal(got, big)


def test_sends_queue_until_the_peer_binds_and_close_flushes() -> None:
    # Stages start in any order: messages to a peer that is not up yet wait, in order, unbounded.
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"  # below the ephemeral range: the sender dials it early
    sender = Transport("stage0", None, PLAN)
    sender.connect("stage1", endpoint)
    n = 3000  # well past ZeroMQ's default high-water mark of 1000

    def send_all() -> None:
        for mb in range(n):
            sender.send("stage1", "act", mb=mb, tensors={"x": torch.tensor([mb])})

    # In a thread so that a blocking send fails the test instead of hanging it.
    worker = threading.Thread(target=send_all, daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "send() blocked while the peer was down: the schedule would deadlock"
    with Transport("stage1", endpoint, PLAN, recv_timeout_s=20) as receiver:
        sender.close()  # lingers until the queue is handed over to the now-live peer
        assert [receiver.recv("act").mb for _ in range(n)] == list(range(n))


def test_a_port_let_go_within_seconds_is_bound() -> None:
    """A stage's port still held for a moment (its process under the run's previous plan closing, or a peer on this
    machine that dialed it early and was handed it as its own port) is tried again, not refused at once; one held
    past BIND_RETRY_S is refused in one line (test_setup_errors_are_one_line_wire_errors)."""
    from hetero.runtime.wire.inbox import BIND_RETRY_S

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    endpoint = f"tcp://127.0.0.1:{held.getsockname()[1]}"
    threading.Timer(1.0, held.close).start()
    start = time.monotonic()
    with Transport("stage1", endpoint, PLAN) as receiver:  # without the retry: "cannot listen on ..." at once
        assert receiver.endpoint == endpoint and time.monotonic() - start > 0.9 and BIND_RETRY_S > 1.0


def test_setup_errors_are_one_line_wire_errors(pair) -> None:
    a, _ = pair
    with pytest.raises(WireError, match="cannot listen on .*another process"):
        Transport("stage9", a.endpoint, PLAN)
    with pytest.raises(WireError, match="no connection to 'stage7'"):
        a.send("stage7", "act")
    with pytest.raises(WireError, match="tcp://HOST:PORT"):
        a.connect("stage8", "127.0.0.1:5000")
    with Transport("launcher", None, PLAN) as launcher, pytest.raises(WireError, match="cannot receive"):
        launcher.recv()


def test_bind_only_the_plans_address() -> None:
    assert bind_address("tcp://192.168.1.20:29500") == "tcp://192.168.1.20:29500"
    assert bind_address("tcp://127.0.0.1:29502") == "tcp://127.0.0.1:29502"
    assert bind_address("tcp://localhost:29503") == "tcp://127.0.0.1:29503"
    assert bind_address("tcp://[::1]:29504") == "tcp://[::1]:29504"


def test_a_stage_listens_only_on_its_plan_address() -> None:
    # 127.0.0.2 stands in for a LAN address: the port is not open on the host's other addresses.
    with Transport("stage1", "tcp://127.0.0.2:0", PLAN, recv_timeout_s=10) as lan:
        host, port = lan.endpoint.rsplit(":", 1)
        assert host == "tcp://127.0.0.2" and int(port) > 0
        with Transport("stage0", None, PLAN) as peer:
            peer.connect("stage1", f"tcp://127.0.0.1:{port}")  # another address of the same host
            peer.send("stage1", "heartbeat", meta={"t": 0})
            with pytest.raises(WireError, match="no 'heartbeat'"):
                lan.recv("heartbeat", timeout_s=0.5)
            peer.set_linger(0)  # nothing listens there: drop, do not wait
            peer.connect("stage1", f"tcp://127.0.0.2:{port}")
            peer.send("stage1", "heartbeat", meta={"t": 1})
            assert lan.recv("heartbeat").meta == {"t": 1}


def test_an_address_that_is_not_this_hosts_is_one_line() -> None:
    with pytest.raises(WireError, match="cannot listen on .*check the host's address in the fleet file"):
        Transport("stage1", "tcp://192.0.2.7:0", PLAN)  # TEST-NET-1: never a local address


ECHO_CHILD = """
import sys
from hetero.runtime.wire.transport import Transport
parent, n = sys.argv[1], int(sys.argv[2])
with Transport("stage1", "tcp://127.0.0.1:0", sys.argv[3], recv_timeout_s=60) as t:
    t.connect("stage0", parent)
    t.send("stage0", "hello", meta={"endpoint": t.endpoint})
    for _ in range(n):
        m = t.recv("act")
        t.send("stage0", "grad", step=m.step, mb=m.mb, tensors=m.tensors, meta=m.meta)
"""


def test_every_dtype_round_trips_across_processes() -> None:
    sent = sample_tensors()
    with Transport("stage0", "tcp://127.0.0.1:0", PLAN, recv_timeout_s=60) as t:
        child = subprocess.Popen([sys.executable, "-c", ECHO_CHILD, t.endpoint, "3", PLAN], cwd=ROOT)
        try:
            t.connect("stage1", t.recv("hello", sender="stage1").meta["endpoint"])
            for mb in range(3):
                t.send("stage1", "act", step=2, mb=mb, tensors=sent, meta={"mb": mb})
            for mb in (2, 0, 1):
                echo = t.recv("grad", step=2, mb=mb, sender="stage1")
                assert echo.meta == {"mb": mb}
                assert_same(echo.tensors, sent)
            assert child.wait(timeout=60) == 0
        finally:
            child.kill()


_UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def unsafe_deserialization(path: pathlib.Path) -> list[str]:
    """Code (not prose) in ``path`` that could rebuild Python objects from bytes."""
    found = []
    toks = list(tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline))
    for i, tok in enumerate(toks):
        where = f"{path.name}:{tok.start[0]}"
        if tok.type == tokenize.NAME and ("pickle" in tok.string.lower() or tok.string in _UNSAFE_MODULES):
            found.append(f"{where} {tok.string}")
        elif tok.type == tokenize.STRING and tok.string.strip("\'\"rbuRBU") in _UNSAFE_MODULES:
            found.append(f"{where} {tok.string}")  # importlib.import_module("pickle") and the like
        elif (tok.type == tokenize.NAME and tok.string == "torch" and i + 2 < len(toks)
              and toks[i + 1].string == "." and toks[i + 2].string == "load"):
            found.append(f"{where} torch.load")
    return found


def test_unsafe_deserialization_detector_catches_real_uses(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('import pickle\nx = torch.load(f)\nm = importlib.import_module("dill")\n'
                   'np.load(f, allow_pickle=True)\n# a pickle in a comment is fine\ns = "not a pickle"\n')
    assert [hit.split(" ")[1] for hit in unsafe_deserialization(bad)] == [
        "pickle", "torch.load", '"dill"', "allow_pickle"]


def test_runtime_never_unpickles() -> None:
    # The word may appear in prose (an error telling users why a .bin is refused); never in code.
    offenders = [hit for p in sorted((ROOT / "runtime").rglob("*.py")) for hit in unsafe_deserialization(p)]
    assert offenders == [], f"runtime/ must never deserialize Python objects: {offenders}"


def test_describe_environment_is_json_and_names_the_stack() -> None:
    env = describe_environment("cpu")
    decoded = json.loads(json.dumps(env))
    assert decoded["torch"] == torch.__version__
    assert decoded["packages"]["pyzmq"] == zmq.__version__
    assert decoded["cuda"] == torch.version.cuda and decoded["cpu_count"] >= 1
    assert decoded["hostname"] == socket.gethostname()
    if not torch.cuda.is_available():
        assert decoded["devices"] == []


def test_encoded_frames_are_what_send_puts_on_the_wire(pair) -> None:
    # A raw PULL socket sees exactly encode()'s frames: the format is the socket-level contract.
    a, _ = pair
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        a.connect("probe", f"tcp://127.0.0.1:{port}")
        x = torch.arange(6, dtype=torch.int32)
        a.send("probe", "labels", step=5, mb=1, tensors={"y": x})
        assert pull.poll(10_000)
        got = pull.recv_multipart()
        want = encode(Message("labels", "stage0", step=5, mb=1, tensors={"y": x}), PLAN)
        assert got == [bytes(f) for f in want]
    finally:
        pull.close(linger=0)
        ctx.term()


def test_send_to_a_peer_whose_handshake_fails_errors_instead_of_hanging(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A port held by a ZeroMQ inbox whose gatekeeper refuses us (another run's stage: its ZAP handler
    does not know this process): ZeroMQ drops the connection's queue and does not retry, and a blocking
    send used to wait forever while holding the send lock (a whole run hung with it, heartbeats
    included). Now the send fails in one line and sends to other peers go on meanwhile.

    (A peer that merely closes the connection mid-handshake, a mechanism mismatch, makes ZeroMQ keep
    the queue and redial: sends queue, and ConnectionWatch.refused says who refuses: test_preflight.)"""
    from zmq.auth.thread import ThreadAuthenticator

    import hetero.runtime.wire.transport as transport_mod

    monkeypatch.setattr(transport_mod, "SEND_STALL_S", 1.0)
    ctx = zmq.Context()
    gate = ThreadAuthenticator(ctx)
    gate.start()
    gate.deny("127.0.0.1")  # the other run's gatekeeper: this process is not one of its plan's
    foreign = ctx.socket(zmq.PULL)
    foreign.zap_domain = b"another-run"
    port = foreign.bind_to_random_port("tcp://127.0.0.1")
    outcome: dict[str, object] = {}
    # A failed assertion must not leave sockets that make the interpreter's exit wait for them forever.
    with Transport("coordinator", "tcp://127.0.0.1:0", "planhash", recv_timeout_s=5) as tr, \
            Transport("stage1", "tcp://127.0.0.1:0", "planhash", recv_timeout_s=5) as good, \
            contextlib.ExitStack() as cleanup:  # runs first: tr's linger, then the foreign socket and context
        cleanup.callback(ctx.term)
        cleanup.callback(gate.stop)
        cleanup.callback(foreign.close, 0)
        cleanup.callback(tr.set_linger, 0)
        tr.connect("stage2", f"tcp://127.0.0.1:{port}")
        tr.connect("stage1", good.endpoint)

        def hammer() -> None:
            try:
                for _ in range(200):
                    tr.send("stage2", "heartbeat")
                    time.sleep(0.02)
                outcome["error"] = None
            except WireError as exc:
                outcome["error"] = str(exc)

        thread = threading.Thread(target=hammer, daemon=True)
        thread.start()
        time.sleep(0.5)
        tr.send("stage1", "heartbeat")  # the lock is not held by the stalled peer
        assert good.recv("heartbeat", timeout_s=5).sender == "coordinator"
        thread.join(timeout=20)
        assert not thread.is_alive(), "send to the refusing peer hung"
        assert "cannot send to stage2" in str(outcome["error"]) and "handshake failed" in str(outcome["error"])
