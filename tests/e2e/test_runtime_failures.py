"""A run that fails or is interrupted: noticed within runtime.failure_timeout_s, said in one line, no
process left behind, and `--resume RUN_DIR` ends exactly where an uninterrupted run ends.

The process tests run the tiny model as three CPU stages of real `hetero run` processes and compare
the resumed adapters bit for bit with one uninterrupted run (module fixture ``reference``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from plans import free_ports, make_plan
from procs import clean_up, finish, start
from runs import _adapter, _alive, _assert_no_process_left, _metrics, _one_error_line, _port, _stage_pids

from hetero.errors import ConfigError
from hetero.runtime.base.processes import exit_cause
from hetero.runtime.cli import RUN_OPTIONS, resume_train, split_run_options
from hetero.runtime.wire.control import Heartbeat, Mailbox, PeerLost
from hetero.runtime.wire.transport import Transport
from hetero.specs import ModelSpec, TrainSpec

FAILURE_TIMEOUT_S = 5.0
STEPS = 10
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=STEPS, lr=1e-3)
# Given to the interrupted runs only: `--resume` must take them from the checkpoint.
SETTINGS = ["lr=2e-3", "scheduler=cosine", "warmup_steps=2", "max_grad_norm=0.5"]
# runtime.elastic=off: these runs stop at a lost stage (tests/e2e/test_elastic.py has the runs that go on without it).
RUNTIME = [f"runtime.failure_timeout_s={FAILURE_TIMEOUT_S:g}", "runtime.elastic=off"]

# -- the control plane, in one process ---------------------------------------------------------------


def _pair() -> tuple[Transport, Transport]:
    a = Transport("a", "tcp://127.0.0.1:0", "plan", recv_timeout_s=5)
    b = Transport("b", "tcp://127.0.0.1:0", "plan", recv_timeout_s=5)
    assert a.endpoint and b.endpoint
    a.connect("b", b.endpoint)
    b.connect("a", a.endpoint)
    return a, b


def test_a_silent_peer_is_named_within_its_bound_and_a_busy_listener_is_not_fooled() -> None:
    a, b = _pair()
    beat = Heartbeat(a, ["b"], interval_s=0.2)
    mailbox = Mailbox(b, watch={"a": time.monotonic()}, silence_s=1.5)
    try:
        beat.start()
        time.sleep(3.0)  # busy: a's heartbeats wait unread in b's socket, older than the bound
        with pytest.raises(Exception, match="no 'x' step"):  # a timeout, not "a is silent"
            mailbox.recv("x", step=0, timeout_s=1.5)
        beat.finish()
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match=r"no heartbeat for 1.5 s \(hung or stopped\?\)") as lost:
            mailbox.recv("x", step=0, timeout_s=30)
        assert lost.value.peer == "a" and lost.value.silent
        assert time.monotonic() - t0 < 1.5 + 1.5
    finally:
        beat.finish()
        mailbox.close()
        a.close()
        b.close()


def test_a_dropped_connection_is_a_lost_peer() -> None:
    a, b = _pair()
    mailbox = Mailbox(b)
    mailbox.watch_connections(["a"])
    try:
        a.send("b", "heartbeat")
        mailbox.recv("heartbeat", timeout_s=5)  # b's outbound connection to a is up by now
        time.sleep(0.3)
        a.close()  # a's process exits: its inbox closes
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="connection lost") as lost:
            mailbox.recv("x", step=0, timeout_s=30)
        assert lost.value.peer == "a" and not lost.value.silent
        assert time.monotonic() - t0 < 4
    finally:
        mailbox.close()
        a.close()
        b.close()


def test_exit_causes_read_like_a_person_would_say_them() -> None:
    assert exit_cause(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_cause(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_cause(2) == "exit code 2"


def test_runtime_options_are_checked_in_one_line() -> None:
    rest, values = split_run_options(["lr=1e-4", "runtime.failure_timeout_s=5", "runtime.load_timeout_s=30",
                                      "runtime.rebalance=off", "runtime.step_timeout_s=120",
                                      "runtime.snapshot_every_s=0", "runtime.elastic=off", "runtime.max_recoveries=0"])
    assert rest == ["lr=1e-4"] and values == {"failure_timeout_s": 5.0, "load_timeout_s": 30.0, "rebalance": "off",
                                              "step_timeout_s": 120.0, "snapshot_every_s": 0.0, "elastic": "off",
                                              "max_recoveries": 0}
    assert set(values) | {"wandb"} == set(RUN_OPTIONS)  # runtime.wandb wants wandb installed: test_watching_a_run
    with pytest.raises(ConfigError, match=r"unknown run option 'runtime.colour'; `hetero run` accepts "
                                          r"runtime.elastic, runtime.failure_timeout_s, runtime.load_timeout_s, "
                                          r"runtime.max_recoveries, runtime.rebalance"):
        split_run_options(["runtime.colour=red"])
    with pytest.raises(ConfigError, match=r"runtime.rebalance must be one of auto, off, got 'sometimes'"):
        split_run_options(["runtime.rebalance=sometimes"])
    with pytest.raises(ConfigError, match=r"runtime.elastic must be one of auto, off, got 'on'"):
        split_run_options(["runtime.elastic=on"])
    for bad in ("runtime.max_recoveries=-1", "runtime.max_recoveries=2.5", "runtime.max_recoveries=many"):
        with pytest.raises(ConfigError, match=r"runtime.max_recoveries must be a whole number from 0 to 1000"):
            split_run_options([bad])
    for bad in ("runtime.failure_timeout_s=soon", "runtime.failure_timeout_s=0.2", "runtime.failure_timeout_s"):
        with pytest.raises(ConfigError, match="must be a number of seconds >= 1"):
            split_run_options([bad])


def test_resume_keeps_the_checkpoint_settings_unless_the_command_line_changes_them() -> None:
    plan_train = TrainSpec(lr=1e-3, scheduler="constant", steps=10)
    saved = {"lr": 3.5e-05, "scheduler": "cosine", "warmup_steps": 2, "steps": 10, "seed": 4}
    train, note = resume_train(plan_train, [], saved)
    assert (train.lr, train.scheduler, train.warmup_steps, train.seed) == (3.5e-05, "cosine", 2, 4) and note is None
    train, note = resume_train(plan_train, ["scheduler=cosine", "train.lr=1e-3", "steps=20"], saved)
    assert (train.lr, train.scheduler, train.steps) == (1e-3, "cosine", 20)
    assert note == ("hetero run: resuming with settings that differ from the checkpoint: lr: checkpoint 3.5e-05, "
                    "now 1e-3 (from the command line); steps: checkpoint 10, now 20 (from the command line)")
    train, note = resume_train(plan_train, ["lr=2e-4"], None)  # an older checkpoint: plan.json + command line
    assert train.lr == 2e-4 and train.scheduler == "constant" and note is None


# -- real runs -----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_leftovers():
    """Whatever a failing test started is killed, stopped stages included."""
    yield
    clean_up()


def _run(plan: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    return start(["run", str(plan), "--run-dir", str(run_dir), "--port", str(free_ports(1)[0]), "--no-progress",
                   *RUNTIME, *extra], plan.parent)


def _wait_for(what: str, ready, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            raise AssertionError(f"{what} never happened (exit {proc.returncode})\nstdout:{out}\nstderr:{err}")
        time.sleep(0.05)


def _exit_within(proc: subprocess.Popen, since: float, bound: float) -> tuple[int, str, float]:
    try:
        proc.wait(timeout=bound + 60)
    except subprocess.TimeoutExpired:
        pass
    took = time.monotonic() - since
    code, _, err = finish(proc, 5)
    assert took <= bound, f"`hetero run` took {took:.1f} s to exit (bound {bound} s)\n{err}"
    return code, err, took


def _assert_same_run(run_dir: Path, reference: dict) -> None:
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # every step once: earlier lines kept, redone ones not
    assert [(m["loss"], m["lr"]) for m in metrics] == reference["losses"]
    state = _adapter(run_dir)
    assert set(state) == set(reference["adapter"])
    for key, want in reference["adapter"].items():
        assert torch.equal(state[key], want), key


@pytest.fixture(scope="module")
def root(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("failures")
    make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=TRAIN).save(root / "plan.json")
    return root


@pytest.fixture(scope="module")
def reference(root: Path) -> dict:
    """One uninterrupted run with SETTINGS: its per-step (loss, lr) and final adapter."""
    run_dir = root / "reference"
    # With every warning switched on, as the README's main command's `hetero run`: library warnings go to
    # the run's logs/warnings.log, and the terminal shows hetero's own lines only.
    run = start(["run", str(root / "plan.json"), "--run-dir", str(run_dir), "--port", str(free_ports(1)[0]),
                 *RUNTIME, *SETTINGS], root.parent, PYTHONWARNINGS="always")
    code, out, err = finish(run)
    assert code == 0, err[-3000:]
    assert "Warning" not in out + err and "adapter:" in out, err[-3000:]
    # The run is a profile, and it says how to plan the next run from it.
    assert "plan the next run from what this one measured: hetero compile " in out and f"profile={run_dir}" in out
    # Stage output goes to the stages' logs. (Their library warnings came from peft, which stages no longer
    # import: with every warning on, a stage now raises none.)
    assert "built in" in (run_dir / "logs" / "stage1.log").read_text()
    metrics = _metrics(run_dir)
    assert len({round(m["lr"], 12) for m in metrics}) > 3  # the cosine schedule really acts
    return {"losses": [(m["loss"], m["lr"]) for m in metrics], "adapter": _adapter(run_dir)}


def _signal_middle_stage(run: subprocess.Popen, run_dir: Path, sig: signal.Signals) -> tuple[list[int], str]:
    """Send ``sig`` to stage 1; `hetero run` must exit 2 within the failure bound. The stage pids and its error line."""
    pids = _stage_pids(run_dir)
    t0 = time.monotonic()
    os.kill(pids[1], sig)
    code, err, took = _exit_within(run, t0, FAILURE_TIMEOUT_S + 5)
    print(f"{sig.name}: `hetero run` exited {took:.2f} s after it")
    assert code == 2
    return pids, _one_error_line(err)


@pytest.mark.slow
def test_a_killed_stage_stops_the_run_in_one_line_and_resume_finishes_it(root: Path, reference: dict) -> None:
    run_dir = root / "killed"
    run = _run(root / "plan.json", run_dir, *SETTINGS, "checkpoint_every=2")
    _wait_for("the step-2 checkpoint", lambda: (run_dir / "checkpoints" / "step-000002" / "COMPLETE").is_file(), run)
    pids, line = _signal_middle_stage(run, run_dir, signal.SIGKILL)
    assert f"stage 1 exited on host localhost (pid {pids[1]}): killed by SIGKILL" in line, line
    assert f"continue after step 2 with `hetero run {run_dir / 'plan.json'} --port {_port(run)} --resume {run_dir}`" in line \
        or f"continue after step 4 with `hetero run {run_dir / 'plan.json'} --port {_port(run)} --resume {run_dir}`" in line, line
    _assert_no_process_left(run_dir, pids)
    assert not (run_dir / "adapter").exists()

    # The command the line gives, run as printed (from another directory), finishes the run.
    printed = re.search(r"continue after step \d+ with `([^`]+)`", line)
    assert printed, line
    command = shlex.split(printed.group(1))
    assert command[:2] == ["hetero", "run"]
    code, out, err = finish(start([*command[1:], "--no-progress"], root.parent))
    assert code == 0, err[-3000:]
    assert "differ from the checkpoint" not in out
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_a_run_whose_coordinator_dies_resumes_from_its_last_snapshot(root: Path) -> None:
    """No checkpoint option: the run writes snapshots by time (runtime.snapshot_every_s), keeps the newest two,
    and a coordinator SIGKILLed mid-run resumes from the newest one to exactly the losses and adapter of a run
    that was never stopped (one that snapshots too: snapshots change nothing)."""
    steps = ["steps=30", "runtime.snapshot_every_s=1"]
    whole = root / "snapshots-whole"
    code, _, err = finish(_run(root / "plan.json", whole, *SETTINGS, *steps))
    assert code == 0, err[-3000:]
    markers = {d.name: json.loads((d / "COMPLETE").read_text()) for d in sorted((whole / "checkpoints").iterdir())}
    assert markers.pop("step-000030").get("snapshot") is None  # the end of training: a checkpoint of its own
    assert 1 <= len(markers) <= 2 and all(m["snapshot"] is True for m in markers.values()), markers

    run_dir = root / "snapshots-killed"
    run = _run(root / "plan.json", run_dir, *SETTINGS, *steps)
    _wait_for("a snapshot", lambda: any((run_dir / "checkpoints").glob("step-*/COMPLETE")), run)
    pids = _stage_pids(run_dir)
    run.kill()  # SIGKILL: no Ctrl-C checkpoint, no goodbye to the stages
    run.communicate()
    deadline = time.monotonic() + FAILURE_TIMEOUT_S + 10  # the stages miss the coordinator's heartbeats and go
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "stages outlived their coordinator"
    snapshot = max((run_dir / "checkpoints").glob("step-*/COMPLETE")).parent
    assert json.loads((snapshot / "COMPLETE").read_text())["snapshot"] is True
    assert not (run_dir / "adapter").exists()

    code, out, err = finish(start(["run", str(run_dir / "plan.json"), "--resume", str(run_dir), "--port",
                                   str(free_ports(1)[0]), "--no-progress", *RUNTIME], root.parent))
    assert code == 0, err[-3000:]
    resumed, reference = _metrics(run_dir), _metrics(whole)
    assert [m["step"] for m in resumed] == list(range(1, 31))
    assert [(m["loss"], m["lr"]) for m in resumed] == [(m["loss"], m["lr"]) for m in reference]
    state, want = _adapter(run_dir), _adapter(whole)
    assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_stopped_stage_is_found_within_the_failure_timeout_and_killed(root: Path) -> None:
    run_dir = root / "stopped"
    run = _run(root / "plan.json", run_dir, "steps=400")
    _wait_for("the first step", lambda: bool(_metrics(run_dir)), run)
    pids, line = _signal_middle_stage(run, run_dir, signal.SIGSTOP)
    assert (f"stage 1 stopped responding on host localhost (pid {pids[1]}): no heartbeat for {FAILURE_TIMEOUT_S:g} s "
            "(the process is stopped: SIGSTOP or Ctrl-Z?)") in line, line
    assert "no checkpoint yet" in line and f"--run-dir {run_dir}" in line, line
    _assert_no_process_left(run_dir, pids)  # SIGKILL ends a stopped process; SIGTERM would not


@pytest.mark.slow
def test_ctrl_c_checkpoints_at_the_next_step_and_resume_finishes_the_run(root: Path, reference: dict) -> None:
    run_dir = root / "interrupted"
    run = _run(root / "plan.json", run_dir, *SETTINGS)  # checkpoint_every=0: only Ctrl-C writes one
    _wait_for("the first step", lambda: bool(_metrics(run_dir)), run)
    pids = _stage_pids(run_dir)
    run.send_signal(signal.SIGINT)
    code, out, err = finish(run, 120)
    assert code == 130, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("hetero:")]
    assert len(line) == 1 and "Traceback" not in err, err
    done = len(_metrics(run_dir))
    checkpoint = run_dir / "checkpoints" / f"step-{done:06d}"
    assert (checkpoint / "COMPLETE").is_file()
    assert line[0] == (f"hetero: interrupted after step {done}: checkpoint {checkpoint}; continue with "
                       f"`hetero run {run_dir / 'plan.json'} --port {_port(run)} --resume {run_dir}`")
    assert done < STEPS
    _assert_no_process_left(run_dir, pids)

    # The original plan.json (without SETTINGS): the checkpoint's settings are the ones that go on.
    resume = start(["run", "plan.json", "--resume", str(run_dir), "--port", str(free_ports(1)[0]), "--no-progress"],
                    root)
    code, out, err = finish(resume)
    assert code == 0, err[-3000:]
    assert "differ from the checkpoint" not in out
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_stages_whose_coordinator_vanished_exit_on_their_own(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                              tmp_path: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=replace(TRAIN, steps=400),
                     hosts=["alpha", "beta", "beta"])
    plan.save(tmp_path / "plan.json")
    port = free_ports(1)[0]
    worker = start(["worker", "plan.json", "--host", "beta", "--coordinator", f"tcp://127.0.0.1:{port}",
                     "--run-dir", str(tmp_path / "beta")], tmp_path)
    run_dir = tmp_path / "run"
    run = start(["run", "plan.json", "--run-dir", str(run_dir), "--port", str(port), "--no-progress", *RUNTIME],
                 tmp_path)
    _wait_for("the first step", lambda: bool(_metrics(run_dir)), run)
    pids = _stage_pids(run_dir)
    t0 = time.monotonic()
    run.kill()  # the coordinator vanishes; nobody sends stop
    run.communicate()
    worker_code: list[int] = []
    waiter = threading.Thread(target=lambda: worker_code.append(worker.wait()), daemon=True)
    waiter.start()
    waiter.join(FAILURE_TIMEOUT_S + 5)
    took = time.monotonic() - t0
    print(f"coordinator killed: the remote host's stages were gone {took:.2f} s later")
    assert worker_code, f"`hetero worker` still runs {took:.0f} s after its coordinator vanished"
    assert not [p for p in pids if _alive(p)], "stages outlived their coordinator"


def _ctrl_c_twice(run: subprocess.Popen) -> tuple[int, str]:
    """SIGINT, and once `hetero run` has taken it (its "stopping after this step" line), SIGINT again; (exit code,
    stderr). Two signals sent back to back would reach Python's handler as one."""
    seen: list[str] = []

    def read() -> None:
        for line in run.stderr:  # type: ignore[union-attr]
            seen.append(line)
            if "stopping after this step" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    run.send_signal(signal.SIGINT)
    reader.join(60)
    assert seen and "stopping after this step" in seen[-1], seen
    run.send_signal(signal.SIGINT)
    code, _, rest = finish(run, 60)
    return code, "".join(seen) + rest


@pytest.mark.slow
def test_a_second_ctrl_c_still_says_how_to_resume(root: Path) -> None:
    """Two SIGINTs, the second while the first one's checkpoint is asked for or written: `hetero run` stops at once,
    exits 130 and says how to continue from the newest complete checkpoint (checkpoint_every=2 wrote some);
    the command it prints resumes the run."""
    run_dir = root / "twice"
    run = _run(root / "plan.json", run_dir, "steps=400", "checkpoint_every=2")
    _wait_for("the step-2 checkpoint", lambda: (run_dir / "checkpoints" / "step-000002" / "COMPLETE").is_file(), run)
    pids = _stage_pids(run_dir)
    code, err = _ctrl_c_twice(run)
    assert code == 130, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("hetero:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    newest = sorted((run_dir / "checkpoints").glob("step-*/COMPLETE"))[-1].parent
    step = int(newest.name.split("-")[1])
    assert lines[0] == (f"hetero: stopped at once; newest checkpoint {newest} (after step {step}): continue with "
                        f"`hetero run {run_dir / 'plan.json'} --port {_port(run)} --resume {run_dir}`"), lines[0]
    _assert_no_process_left(run_dir, pids)
    printed = shlex.split(lines[0].split("`")[1])
    code, out, err = finish(start([*printed[1:], "--no-progress", f"steps={step + 2}"], root.parent))
    assert code == 0, err[-3000:]
    assert [m["step"] for m in _metrics(run_dir)] == list(range(1, step + 3))


@pytest.mark.slow
def test_two_ctrl_c_before_any_checkpoint_say_there_is_nothing_to_keep(root: Path) -> None:
    run_dir = root / "twice-early"
    run = _run(root / "plan.json", run_dir, "steps=400")  # checkpoint_every=0: only the first Ctrl-C would write one
    _wait_for("the first step", lambda: bool(_metrics(run_dir)), run)
    code, err = _ctrl_c_twice(run)
    assert code == 130, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("hetero:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    complete = sorted((run_dir / "checkpoints").glob("step-*/COMPLETE"))
    if complete:  # the first Ctrl-C's checkpoint was written before the second came
        assert lines[0].startswith(f"hetero: stopped at once; newest checkpoint {complete[-1].parent} "), lines[0]
    else:
        assert lines[0] == ("hetero: stopped at once, before any checkpoint was complete: nothing to keep; start again "
                            f"with `hetero run {run_dir / 'plan.json'} --port {_port(run)} --run-dir {run_dir}`"), lines[0]


@pytest.mark.slow
def test_a_step_past_runtime_step_timeout_s_stops_the_run_in_one_line(root: Path) -> None:
    """A stage that still exists but never finishes its step (stopped here, with a failure bound longer than the
    step limit): the step limit ends the run, and its line says which limit and how to raise it."""
    run_dir = root / "stuck"
    run = start(["run", str(root / "plan.json"), "--run-dir", str(run_dir), "--port", str(free_ports(1)[0]),
                 "--no-progress", "steps=400", "runtime.failure_timeout_s=60", "runtime.step_timeout_s=8"], root.parent)
    _wait_for("the first step", lambda: bool(_metrics(run_dir)), run)
    pids = _stage_pids(run_dir)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    code, err, took = _exit_within(run, t0, 8 + 10)
    line = _one_error_line(err)
    assert code == 2
    assert re.search(r"stage\(s\) .*1.* on localhost sent no '\w+' for step \d+ within 8 s: the step took longer "
                     r"than runtime.step_timeout_s \(8 s; the plan predicts [\d.e-]+ s a step\)", line), line
    assert "runtime.step_timeout_s=60 or more" in line, line
    # runtime.elastic=auto (the default) copies the stages' state every step or so: the line names that copy, on disk
    # by then, when one was made before the stage stopped; otherwise there is nothing to continue from.
    kept = re.search(r"continue after step (\d+) with `", line)
    assert (kept and (run_dir / "checkpoints" / f"step-{int(kept.group(1)):06d}" / "COMPLETE").is_file()
            or "no checkpoint yet" in line), line
    _assert_no_process_left(run_dir, pids)
