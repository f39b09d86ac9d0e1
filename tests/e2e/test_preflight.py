"""What can be checked before training is checked before it starts, and nothing waits for what cannot come.

A checkpoint converted to another dtype, a host started with another plan.json, a handshake that fails:
each is one line within seconds that names the file or the host and says what to do, where it used to be
a wait of 600 s (the handshake timeout) or a hang of 616 s (a stage waiting for a state its rules dropped).
The process tests run `hetero run` / `hetero worker` on the tiny model as real processes.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
import torch
from plans import free_ports, make_plan
from procs import HETERO, clean_up, finish, run_hetero, start
from safetensors.torch import load_file, save_file

from hetero.errors import CheckpointError, ConfigError, WireError
from hetero.plan import Plan, compute_input_hash
from hetero.runtime.cli import split_run_options
from hetero.runtime.run.checkpoint import write_checkpoint
from hetero.runtime.run.options import STEP_TIMEOUT_MIN_S, step_timeout_s
from hetero.runtime.run.preflight import check_resume, lora_shapes
from hetero.runtime.stage.process import _await_state
from hetero.runtime.stage.state import CHECKPOINT_FORMAT, EXP_AVG, EXP_AVG_SQ, LORA
from hetero.runtime.wire.control import ConnectionWatch, Mailbox
from hetero.runtime.wire.rules import stage_rules
from hetero.runtime.wire.transport import Transport
from hetero.security import COORDINATOR, generate, key_dirs, load_identity
from hetero.specs import ModelSpec, TrainSpec

TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=6)


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    clean_up()


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("hetero: error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# -- checkpoints: every tensor against the plan's LoRA and AdamW state, before any stage starts ---------------


def _checkpoint(plan: Plan, model_dir: Path, run: Path, step: int, r: int | None = None) -> Path:
    """A complete two-file checkpoint with LoRA weights and AdamW moments for every module the plan trains."""
    payloads = []
    shapes = list(lora_shapes(plan, model_dir).items())
    for k, part in enumerate((shapes[: len(shapes) // 2], shapes[len(shapes) // 2:])):
        tensors: dict[str, torch.Tensor] = {}
        for key, shape in part:
            assert shape is not None
            if r is not None:
                shape = (r, shape[1]) if ".lora_A." in key else (shape[0], r)
            tensors[LORA + key] = torch.full(shape, 0.01)
            tensors[EXP_AVG + key] = torch.zeros(shape)
            tensors[EXP_AVG_SQ + key] = torch.full(shape, 1e-8)
        keys = [key for key, _ in part]
        payloads.append((tensors, {"format": CHECKPOINT_FORMAT, "plan_hash": plan.input_hash, "stage": k, "step": step,
                                   "keys": keys, "adam_steps": {key: float(step) for key in keys}, "scheduler": None}))
    return write_checkpoint(run, step, payloads, 2)


def _convert(checkpoint: Path, dtype: torch.dtype, prefix: str = "") -> None:
    """Cast a checkpoint's tensors (those whose name starts with ``prefix``) as a user's script would."""
    for file in sorted(checkpoint.glob("stage*.safetensors")):
        tensors = load_file(str(file))
        save_file({n: t.to(dtype) if n.startswith(prefix) else t for n, t in tensors.items()}, str(file),
                  metadata={"format": str(CHECKPOINT_FORMAT)})


def test_a_converted_checkpoint_names_its_file_tensor_and_the_fix(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                  tmp_path: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN)
    good = _checkpoint(plan, tiny_model_dir, tmp_path / "good", 2)
    assert check_resume(good, plan, tiny_model_dir) == (good, 2)

    for name, dtype, prefix, tensor in [("fp16", torch.float16, "", "(lora|exp_avg|exp_avg_sq)/"),
                                        ("bf16-moment", torch.bfloat16, EXP_AVG_SQ, re.escape(EXP_AVG_SQ))]:
        checkpoint = _checkpoint(plan, tiny_model_dir, tmp_path / name, 2)
        _convert(checkpoint, dtype, prefix)
        with pytest.raises(CheckpointError) as info:
            check_resume(checkpoint, plan, tiny_model_dir)
        line = str(info.value)
        wanted = str(dtype).removeprefix("torch.")
        assert re.fullmatch(rf"{re.escape(str(checkpoint))}/stage0\.safetensors: tensor {tensor}"
                            rf"base_model\.model\.model\.layers\.0\.\S+ is {wanted}, expected float32 .*", line), line
        assert "cast its tensors back to float32" in line and "\n" not in line

    # A tensor of another shape than this plan's LoRA (another lora.r): the file that holds it, and both shapes.
    rank4 = _checkpoint(plan, tiny_model_dir, tmp_path / "r4", 2, r=4)
    with pytest.raises(CheckpointError) as info:
        check_resume(rank4, plan, tiny_model_dir)
    assert re.match(rf"{re.escape(str(rank4))}/stage0\.safetensors: tensor lora/base_model\.model\.model\.layers\.0\."
                    r"\S+ has shape \((4, \d+|\d+, 4)\), this model's is \((8, \d+|\d+, 8)\): .*resume from a checkpoint "
                    "of this model and lora.r", str(info.value)), info.value


def test_a_state_the_stage_refuses_ends_its_wait_at_once(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    """Behind the checks: if a stage's rules ever drop the coordinator's ``state``, the stage says so at once
    (it used to wait 600 s while the coordinator waited for its first step)."""
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN)
    with Transport("stage0", "tcp://127.0.0.1:0", plan.input_hash, rules=stage_rules(plan, 0)) as stage, \
            Transport(COORDINATOR, None, plan.input_hash) as coordinator:
        assert stage.endpoint is not None
        coordinator.connect("stage0", stage.endpoint)
        coordinator.send("stage0", "state", tensors={"lora/x": torch.zeros(2, 2, dtype=torch.float16)})
        t0 = time.monotonic()
        with pytest.raises(WireError, match=r"the coordinator's state for this stage was refused: .*'state' .*"
                                            r"float16, expected float32"):
            _await_state(Mailbox(stage), 600.0)
        assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_an_fp16_checkpoint_is_refused_in_seconds_before_any_stage_starts(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                        tmp_path: Path) -> None:
    """The reported case, as a user meets it: a run's own checkpoint, converted to fp16 with safetensors."""
    make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN).save(tmp_path / "plan.json")
    code, _, err = finish(start(["run", "plan.json", "--run-dir", "run", "--port", str(free_ports(1)[0]), "--no-progress",
                                 "steps=2", "checkpoint_every=2"], tmp_path))
    assert code == 0, err[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    _convert(checkpoint, torch.float16)
    t0 = time.monotonic()
    done = subprocess.run([*HETERO, "run", "plan.json", "--resume", "run", "--run-dir", "again", "steps=4"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    line = _one_line(done.stderr)
    assert done.returncode == 2 and elapsed < 15, (elapsed, done.stderr)  # imports included (~3 s idle)
    assert re.search(r"run/checkpoints/step-000002/stage0\.safetensors: tensor \S+ is float16, expected float32",
                     line), line
    assert not (tmp_path / "again").exists()  # refused before the run directory, let alone a stage


# -- a host started with another plan.json ------------------------------------------------------------------------


def _two_plans(model_dir: Path, spec: ModelSpec, tmp_path: Path, mode: str) -> tuple[Path, Path]:
    """Plan A (stage 0 on alpha, stage 1 on beta) and plan B: the same fleet and ports, another micro-batch size
    (so another plan hash), compiled apart (so, with keys, other keys). Each in its own folder with its keys."""
    a = make_plan(model_dir, spec.architecture, [3, 3], train=TRAIN, hosts=["alpha", "beta"])
    b = replace(a, train=replace(a.train, micro_batch_size=1))
    b = replace(b, input_hash=compute_input_hash(b))
    paths = []
    for name, plan in (("A", a), ("B", b)):
        folder = tmp_path / name
        folder.mkdir()
        plan = replace(plan, security=generate(mode, [s.host for s in plan.stages], folder))  # type: ignore[arg-type]
        plan.save(folder / "plan.json")
        paths.append(folder / "plan.json")
    return paths[0], paths[1]


def _log_time(log: Path, *texts: str) -> float:
    """The wall-clock time of the first line of a stage log that contains one of ``texts``."""
    line = next(ln for ln in log.read_text().splitlines() if any(text in ln for text in texts))
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc, 5)
        time.sleep(0.1)


@pytest.mark.slow
def test_a_host_with_another_plan_is_named_within_seconds(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                          tmp_path: Path) -> None:
    """Without keys: the coordinator reads the plan hash of the worker's hello and names that host, its address
    and both hashes, within seconds of the hello (the handshake timeout is 600 s)."""
    plan_a, plan_b = _two_plans(tiny_model_dir, tiny_spec, tmp_path, "none")
    hash_a, hash_b = Plan.load(plan_a).input_hash, Plan.load(plan_b).input_hash
    port = free_ports(1)[0]
    run = start(["run", "plan.json", "--run-dir", "run", "--port", str(port), "--no-progress"], plan_a.parent)
    worker = start(["worker", "plan.json", "--host", "beta", "--coordinator", f"tcp://127.0.0.1:{port}",
                    "--run-dir", "wrk"], plan_b.parent)
    code, _, err = finish(run, 300)
    ended = time.time()
    line = _one_line(err)
    assert code == 2
    assert line == (f"hetero: error: stage 1 on host beta (127.0.0.1) runs plan {hash_b}, this run's plan is {hash_a}: "
                    f"it was started with another plan.json; copy run/plan.json to beta and restart `hetero worker "
                    f"plan.json --host beta --coordinator tcp://127.0.0.1:{port}` there"), line
    hello = max(_log_time(plan_b.parent / "wrk" / "logs" / "stage1.log", "hello sent"),
                _log_time(plan_a.parent / "run" / "logs" / "stage0.log", "hello sent"))  # both sides running
    assert ended - hello < 10, f"named {ended - hello:.1f} s after both sides were running"
    worker_code, _, worker_err = finish(worker, 60)  # and the worker's own stage says it too, then it ends
    assert worker_code != 0 and f"runs plan {hash_a}, this process runs {hash_b}" in \
        (plan_b.parent / "wrk" / "logs" / "stage1.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token", "curve"])
def test_a_host_with_another_plans_keys_is_named_within_seconds(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                tmp_path: Path, mode: str) -> None:
    """With keys, the other plan's host fails the key check before any message. Its stage, which knows whom it
    dialed, exits naming the coordinator's address and its own plan hash; the coordinator, whose own connection to
    that stage's address fails too, ends the run naming the stage, its host and address, and what to copy."""
    plan_a, plan_b = _two_plans(tiny_model_dir, tiny_spec, tmp_path, mode)
    hash_a, hash_b = Plan.load(plan_a).input_hash, Plan.load(plan_b).input_hash
    stage1 = Plan.load(plan_a).stages[1].endpoint
    port = free_ports(1)[0]
    run = start(["run", "plan.json", "--run-dir", "run", "--port", str(port), "--no-progress",
                 "--handshake-timeout", "120"], plan_a.parent)
    worker = start(["worker", "plan.json", "--host", "beta", "--coordinator", f"tcp://127.0.0.1:{port}",
                    "--run-dir", "wrk"], plan_b.parent)
    code, _, err = finish(run, 300)
    ended = time.time()
    worker_code, _, worker_err = finish(worker, 120)
    log = plan_b.parent / "wrk" / "logs" / "stage1.log"
    line = _one_line(err)
    assert code == 2
    assert line.startswith(f"hetero: error: stage 1's address on host beta ({stage1}) refuses this run's keys ("), line
    assert (f"the `hetero worker` there was started with another plan.json or older keys (its stage log names the "
            f"plan it runs), or another program holds that port; this run's plan is {hash_a}: copy run/plan.json and "
            f"its artifacts/beta/keys to beta and restart `hetero worker plan.json --host beta --coordinator "
            f"tcp://127.0.0.1:{port}` there") in line, line
    # Within 10 s of both sides running (each one's stage said hello): the coordinator's own start-up, which may
    # end after the other plan's stage is up (a loaded 2-core machine takes seconds to import torch), is not the
    # time it takes to name that stage.
    # The other plan's stage may see the refusal (and exit) before it logs its hello: it was up then too.
    both_up = max(_log_time(log, "hello sent", "fails the handshake"),
                  _log_time(plan_a.parent / "run" / "logs" / "stage0.log", "hello sent"))
    assert ended - both_up < 10, f"named {ended - both_up:.1f} s after both sides were running"
    # The other side: that stage exits on its own, naming whom it dialed and the plan it runs.
    assert worker_code != 0
    told = [ln for ln in log.read_text().splitlines() if "fails the handshake" in ln]
    assert told and re.search(rf"the coordinator at tcp://\S*127\.0\.0\.1\S*:{port} fails the handshake", told[0])
    assert f"whose plan is {hash_b}" in told[0] and ("copy the coordinator's plan.json and its artifacts/<host>/keys "
                                                     "folder to this host and restart") in told[0], told[0]
    # `hetero worker` itself ends with the stage's reason, not only its exit code.
    assert re.search(r"hetero: error: stage 1 exited with code 2: .*fails the handshake .*; see \S*stage1\.log",
                     worker_err), worker_err


def test_a_failed_handshake_is_told_by_the_side_that_dialed(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A CURVE key of another plan fails before ZAP is asked, where ZeroMQ gives the refusing inbox no peer address:
    the inbox names the peer from the kernel's closing connections (never its own address), and the dialing side
    names the inbox it dialed."""
    caplog.set_level(logging.WARNING, logger="hetero.runtime.wire.transport")
    plan_a, plan_b = _two_plans(tiny_model_dir, tiny_spec, tmp_path, "curve")
    a, b = Plan.load(plan_a), Plan.load(plan_b)

    def identity(plan: Plan, path: Path, name: str):
        return load_identity(plan.security, name, key_dirs(path, plan.stages[0].host))

    with Transport("stage0", "tcp://127.0.0.1:0", a.input_hash, identity=identity(a, plan_a, "stage0"),
                   peer_keys=a.security.public_keys) as inbox, \
            Transport(COORDINATOR, None, b.input_hash, identity=identity(b, plan_b, COORDINATOR),
                      peer_keys=b.security.public_keys) as dialer:
        assert inbox.endpoint is not None
        dialer.connect("stage0", inbox.endpoint)
        watch = ConnectionWatch(dialer, ["stage0"])
        deadline = time.monotonic() + 10
        while (refused := watch.refused()) is None:
            assert time.monotonic() < deadline, "the dialing side never saw its handshake fail"
            time.sleep(0.1)
        watch.close()
        dialer.set_linger(0)
        peer, endpoint, why = refused
        assert peer == "stage0" and endpoint.endswith(f":{inbox.endpoint.rsplit(':', 1)[1]}") and why, refused
        while inbox.refused_handshakes() == 0:
            assert time.monotonic() < deadline + 5
            time.sleep(0.1)
    refusals = [r.getMessage() for r in caplog.records if "stage0 refused a connection" in r.getMessage()]
    # The refusing side names the peer (the dialer's own port, looked up in the kernel), never its own address.
    inbox_port = inbox.endpoint.rsplit(":", 1)[1]
    named = [re.match(r"stage0 refused a connection from 127\.0\.0\.1:(\d+): ZeroMQ handshake failed at its inbox "
                      r"\S+: its CURVE hello is sealed for another key", ln) for ln in refusals]
    assert refusals and all(named), refusals
    assert all(m.group(1) != inbox_port for m in named if m), refusals


# -- the per-step limit -------------------------------------------------------------------------------------------


def test_the_step_limit_is_settable_and_follows_the_plan(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN)
    assert split_run_options(["runtime.step_timeout_s=90", "lr=1e-4"]) == (["lr=1e-4"], {"step_timeout_s": 90.0})
    with pytest.raises(ConfigError, match="runtime.step_timeout_s must be a number of seconds >= 1"):
        split_run_options(["runtime.step_timeout_s=0"])
    slow = replace(plan, prediction=replace(plan.prediction, step_time_s=12.5))
    fast = replace(plan, prediction=replace(plan.prediction, step_time_s=0.01))
    assert step_timeout_s(slow) == 250.0  # 20x the predicted step
    assert step_timeout_s(fast) == STEP_TIMEOUT_MIN_S == 60.0  # never below a minute
    assert step_timeout_s(fast, 7.0) == 7.0  # runtime.step_timeout_s wins


def test_a_port_in_use_and_an_address_this_machine_lacks_are_told_apart(tiny_model_dir: Path,
                                                                        tiny_spec: ModelSpec) -> None:
    """A busy port names another process; an address that is not this machine's (EADDRNOTAVAIL: `hetero run` started
    on the wrong box, or a wrong hosts.address) names the host and the fix, not a busy port."""
    import socket

    from hetero.runtime.run.preflight import PortBusyError, check_ports

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN, hosts=["alpha", "beta"])
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PortBusyError, match=rf"the coordinator cannot listen on tcp://127.0.0.1:{port} \(Address "
                                                r"already in use\): another process \(another run\?\) holds the port"):
            check_ports(plan, None, port)
    far = replace(plan, cluster=replace(plan.cluster, hosts=[replace(plan.cluster.hosts[0], address="192.0.2.7"),
                                                              *plan.cluster.hosts[1:]]))
    with pytest.raises(PortBusyError) as refused:
        check_ports(far, None, None)
    assert re.fullmatch(r"the coordinator cannot listen on tcp://192\.0\.2\.7:\d+ \(Cannot assign requested address\): "
                        r"this machine does not have alpha's address 192\.0\.2\.7 \(the fleet file's hosts\.address\): "
                        r"run `hetero run` on alpha itself, or pass --host NAME for the host this machine is \(beta\), "
                        r"or correct the address and recompile", str(refused.value)), str(refused.value)


def test_ports_in_the_ephemeral_range_are_warned_of_in_one_line(tmp_path: Path, tiny_model_dir: Path,
                                                                  tiny_spec: ModelSpec, capsys, monkeypatch) -> None:
    """A port the kernel may hand to an outgoing connection can be taken by a peer that dials it before its stage
    listens (it connects to itself; CI met it when a host rejoined): `hetero run` says so in one line, naming the
    ports and what to change, and says nothing of ports below the range or where the machine does not tell it."""
    from hetero.runtime.run import preflight
    from hetero.runtime.wire import endpoints

    span_file = tmp_path / "ip_local_port_range"
    span_file.write_text("32768\t60999\n")
    assert endpoints.ephemeral_ports(str(span_file)) == (32768, 60999)
    assert endpoints.ephemeral_ports(str(tmp_path / "absent")) is None
    span_file.write_text("not a range\n")
    assert endpoints.ephemeral_ports(str(span_file)) is None
    assert endpoints.ports_in([40001, 29500, 60999, 32767, 40001], (32768, 60999)) == [40001, 60999]
    assert endpoints.ports_in([40001], None) == []  # a machine that does not say its range: nothing to warn of

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=TRAIN, hosts=["alpha", "alpha", "beta"])
    preflight.check_ports(plan, None, None)  # its ports are below this machine's range
    assert capsys.readouterr().err == ""
    base = plan.cluster.host("alpha").port
    # This machine's range as if it began at alpha's port + 2: where a re-plan could put alpha's third stage.
    monkeypatch.setattr(endpoints, "ephemeral_ports", lambda: (base + 2, 60999))
    preflight.check_ports(plan, None, None)
    err = capsys.readouterr().err
    second = int(plan.stages[1].endpoint.rsplit(":", 1)[1])  # alpha's second stage (make_plan spaces them out)
    assert second > base + 2
    assert err.count("\n") == 1 and f"hetero run: warning: port(s) {base + 2}, {second} of alpha lie in this " \
        f"machine's ephemeral range ({base + 2}-60999" in err, err
    assert f"give the fleet file's hosts.alpha.port (then recompile) a value below {base + 2}" in err, err
    assert preflight.warn_ephemeral(plan, "alpha", "tcp://127.0.0.1:50000", prog="hetero worker") == [
        base + 2, second, 50000]
    err = capsys.readouterr().err
    assert err.startswith("hetero worker: warning:") and "and the coordinator's port (`hetero run --port`)" in err
    monkeypatch.setattr(endpoints, "ephemeral_ports", lambda: (second + 1, 60999))
    assert preflight.warn_ephemeral(plan, "alpha", f"tcp://127.0.0.1:{base - 1}") == []
    assert capsys.readouterr().err == ""


def test_worker_check_names_what_each_box_lacks_one_line_each(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                              tmp_path: Path) -> None:
    """Three "boxes" on loopback (issue 53): alpha lacks the model's weights (its home has no ~/models/tiny), beta's
    port is taken, gamma declares an RTX 3090 it does not have. `hetero worker --check` names each box's problem in
    one line with its fix and exits 2; a box with everything passes."""
    import json
    import socket

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=TRAIN, hosts=["alpha", "beta", "gamma"])
    gpu = replace(plan.cluster.device(plan.stages[2].device), type="rtx3090", backend="cuda", index=0,
                  display_name="NVIDIA GeForce RTX 3090", memory_gb=24.0)
    cluster = replace(plan.cluster, hosts=[replace(h, devices=[gpu if d.name == gpu.name else d for d in h.devices])
                                           for h in plan.cluster.hosts])
    stages = [replace(s, backend="cuda", device_type="rtx3090") if s.device == gpu.name else s for s in plan.stages]
    plan = replace(plan, cluster=cluster, stages=stages, model=replace(plan.model, pretrained="~/models/tiny"))
    replace(plan, input_hash=compute_input_hash(plan)).save(tmp_path / "plan.json")
    for host in ("beta", "gamma", "ready"):
        (tmp_path / host / "models").mkdir(parents=True)
        (tmp_path / host / "models" / "tiny").symlink_to(tiny_model_dir)
    (tmp_path / "alpha").mkdir()

    def check(host: str, home: str) -> tuple[int, list[str]]:
        done = run_hetero(["worker", "plan.json", "--host", host, "--check"], tmp_path, 120, HOME=str(tmp_path / home))
        assert "Traceback" not in done.stderr, done.stderr
        json.loads(done.stdout.strip().splitlines()[-1].removeprefix("hetero-check: "))  # what `hetero run` reads
        return done.returncode, done.stderr.strip().splitlines()

    port = int(plan.stages[1].endpoint.rsplit(":", 1)[1])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        said = {host: check(host, host) for host in ("alpha", "beta", "gamma")}
    assert all(code == 2 and len(lines) == 1 for code, lines in said.values()), said
    assert "alpha: the model's weights are not on this box: ~/models/tiny" in said["alpha"][1][0]
    assert "copy the model's directory there" in said["alpha"][1][0]
    assert f"beta: port {port} (stage 1's inbox, 127.0.0.1) is in use on this box" in said["beta"][1][0]
    assert re.search(r"gamma: \S+ \(index: 0 in the fleet file, declared NVIDIA GeForce RTX 3090\): torch \S+( \(\S+ \S+\)|, a "
                     r"CPU-only build) sees no GPU on this box: install the torch build for this card", said["gamma"][1][0]), said["gamma"]
    assert check("beta", "ready") == (0, ["hetero worker --check: host beta is ready to run its stages"])
