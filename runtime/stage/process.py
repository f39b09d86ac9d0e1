"""A stage process: ``python -m hetero.runtime.stage.process plan.json --stage k --coordinator tcp://..``
(what `hetero run` and `hetero worker --host` start, one per device).

Life of a stage: hello (plan hash, wire version, environment) -> welcome (run settings, incl. the
`hetero run` overrides) -> build the stage -> ready -> steps (the executor) with a checkpoint message
whenever due -> final checkpoint -> wait for stop. It never outlives the run: it exits on ``stop``,
when the coordinator is silent for ``failure_timeout_s`` (from the welcome) or its connection drops
for good, when its parent process dies, or on any error (reported to the coordinator as one
``error`` line; the traceback goes to the stage's log). Asked for a checkpoint before stopping
(Ctrl-C on `hetero run`), it sends its state from wherever it waits, then waits for the final stop.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError, PlanError, WireError
from hetero.plan import Plan
from hetero.protocol import (
    EXIT_REPLAN,
    FAILURE_TIMEOUT_S,
    Error,
    Hello,
    Rebalance,
    Start,
    StepDone,
    Stop,
    Welcome,
)
from hetero.runtime.wire.control import (
    ConnectionWatch,
    Heartbeat,
    Mailbox,
    PeerLost,
    StopRequested,
    drop_unsent,
    heartbeat_interval,
    is_timeout,
)
from hetero.runtime.wire.frames import record_of
from hetero.security import COORDINATOR, key_dirs
from hetero.serde import from_dict, to_dict
from hetero.specs import TrainSpec

log = logging.getLogger("hetero.stage")


def device_for(plan: Plan, k: int) -> Any:
    """The torch device of stage k on this host (runtime/stage/device.py)."""
    from hetero.runtime.stage.device import card_problem, torch_device

    sp = plan.stages[k]
    index = plan.cluster.device(sp.device).index if sp.backend != "cpu" else 0
    device = torch_device(sp.backend, index, f"stage {k} runs on {sp.device}")
    problem = card_problem(plan.cluster.device(sp.device))  # the declared card, not its neighbour in the box
    if problem is not None:
        raise PlanError(f"stage {k}: {problem}")
    return device


def apply_train_settings(train: TrainSpec, settings: dict[str, Any]) -> TrainSpec:
    """The plan's TrainSpec with the coordinator's run-time values (validated like plan.json)."""
    merged = {**to_dict(train), **settings}
    return from_dict(TrainSpec, merged, "welcome.train", WireError)


def await_welcome(mailbox: Mailbox, transport: Any, plan: Plan, timeout_s: float) -> Any:
    """The coordinator's welcome. Without keys (security none) a coordinator of another plan is a
    misconfiguration, not an attack: stop as soon as its messages show it (they are dropped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return mailbox.recv("welcome", sender=COORDINATOR, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        except WireError as exc:
            if not is_timeout(exc) or time.monotonic() >= deadline:
                raise
        why = transport.last_rejection(COORDINATOR)
        if plan.security.mode == "none" and why is not None and "runs plan" in why:
            raise WireError(f"the coordinator runs another plan ({why})")


def stage_transport(plan: Plan, k: int, keys: list[Path]) -> Any:
    """Stage k's Transport: its key, the plan's public keys, its message rules and size limit."""
    from hetero.runtime.wire.rules import max_message_bytes, stage_rules
    from hetero.runtime.wire.transport import Transport
    from hetero.security import load_identity

    identity = load_identity(plan.security, plan.stage_id(k), keys)
    return Transport(plan.stage_id(k), plan.stages[k].endpoint, plan.input_hash, recv_timeout_s=300.0,
                     identity=identity, peer_keys=plan.security.public_keys,
                     max_message_bytes=max_message_bytes(plan, k), rules=stage_rules(plan, k))


def run_stage(plan: Plan, k: int, coordinator: str, parent_pid: int | None = None,
              keys: list[Path] | None = None, replan_dir: Path | None = None) -> int:
    """Run stage k until the coordinator says stop; returns the process exit code. ``replan_dir``: where a stop
    that carries the run's next plan (runtime.elastic) leaves it for this host's `hetero worker` (EXIT_REPLAN)."""
    # Import the heavy libraries before hello: once the coordinator watches our heartbeats, a long
    # import holding the import lock or the GIL must not look like a dead stage.
    import torch
    import transformers  # noqa: F401

    device = device_for(plan, k)
    if device.type == "cpu":
        torch.set_num_threads(max(1, plan.stages[k].threads or 1))
    transport = stage_transport(plan, k, keys or [])
    heartbeat: Heartbeat | None = None
    linger_ms: int | None = None  # None: close() flushes what is queued (CLOSE_LINGER_S at most per peer)
    try:
        neighbours = _connect(transport, plan, k, coordinator)
        # The heartbeat thread also ends this process if the coordinator's connection drops for good,
        # even while this thread is busy building the stage.
        heartbeat = Heartbeat(transport, [COORDINATOR], parent_pid, watch=[COORDINATOR])
        heartbeat.start()
        mailbox = _say_hello(transport, plan, k, device, coordinator)
        _serve(plan, k, device, mailbox, heartbeat, neighbours)
        linger_ms = 0  # after a stop nothing is left to deliver: do not linger on dead peers
    except StopRequested as stop:
        log.info("stopping: %s", stop)
        linger_ms = 0
        if stop.plan is not None and stop.replan is not None and replan_dir is not None:
            return _leave_plan(replan_dir, stop.replan, stop.plan)
        return 0
    except PeerLost as lost:  # the coordinator is gone: nobody is left to tell
        log.error("stage %d: coordinator %s: exiting", k, lost.cause)
        print(f"hetero: error: stage {k}: the coordinator stopped answering ({lost.cause})", file=sys.stderr, flush=True)
        linger_ms = 0
        return 2
    except Exception as exc:  # report every failure to the coordinator as one line
        linger_ms = 2000  # time for the error line to reach a live coordinator, not for dead neighbours
        return _report_failure(transport, k, exc)
    finally:
        if heartbeat is not None:
            heartbeat.finish()  # before close(): its connection monitor is a socket of the transport's context
        if linger_ms is not None:
            drop_unsent(transport, linger_ms)
        transport.close()
        log.info("stage %d: transport closed", k)
    return 0


def _leave_plan(folder: Path, number: int, text: str) -> int:
    """Write the run's next plan (from the coordinator, authenticated) for this host's worker; EXIT_REPLAN."""
    from hetero.runtime.base.rundir import write_run_file

    name = f"plan-recovery-{number}.json"
    write_run_file(folder, name, text)
    log.info("the run goes on under %s: left for this host's worker", folder / name)
    return EXIT_REPLAN


def _connect(transport: Any, plan: Plan, k: int, coordinator: str) -> tuple[int | None, int | None]:
    """Connect to the coordinator and to k's neighbours within its pipeline replica; returns them. Under an
    interleaved schedule the pipeline is a ring: the last device hands its chunks on to the first device's next."""
    # The heartbeat's watch (started after this) takes a monitor opened before the first dial: ZeroMQ does not dial
    # again after a refused key, so an event missed here would leave this stage waiting for a welcome that never comes.
    transport.watch_from_start(ConnectionWatch.events() if plan.security.mode != "none" else 0)
    transport.connect(COORDINATOR, coordinator)
    transport.watch_from_start(0)  # the neighbours' connections are watched by the coordinator, not here
    neighbours = (plan.prev_stage(k), plan.next_stage(k))
    peers = set(neighbours)
    if plan.stages[k].chunks:
        peers |= {(k - 1) % len(plan.stages), (k + 1) % len(plan.stages)}
    for j in sorted(j for j in peers - {None, k} if j is not None):
        transport.connect(plan.stage_id(j), plan.stages[j].endpoint)
    return neighbours


def _say_hello(transport: Any, plan: Plan, k: int, device: Any, coordinator: str) -> Mailbox:
    """Tell the coordinator who we are (plan, wire version, pid, environment); returns our Mailbox."""
    from hetero.runtime.base.env import describe_environment

    transport.send(COORDINATOR, Hello(stage=k, input_hash=plan.input_hash, pid=os.getpid(),
                                      env=describe_environment(str(device))))
    mailbox = Mailbox(transport)
    log.info("stage %d on %s: hello sent to %s", k, device, coordinator)
    return mailbox


def _serve(plan: Plan, k: int, device: Any, mailbox: Mailbox, heartbeat: Heartbeat,
           neighbours: tuple[int | None, int | None]) -> None:
    """The life of a stage after hello: welcome, build, (state), its steps, stop."""
    welcome = record_of(await_welcome(mailbox, mailbox.transport, plan, 600.0), Welcome)
    plan = _follow_welcome(plan, welcome, mailbox, heartbeat)
    executor = _build(plan, k, device, mailbox, neighbours)
    if welcome.resume:
        _restore(executor, mailbox, k)

    def rebuild(record: Any) -> Any:
        """A rebalance: this stage again, on its new node span, with its new layers' state."""
        nonlocal plan
        plan = plan.with_spans(record.spans, record.recompute)
        return _build(plan, k, device, mailbox, neighbours)

    stage_eval = None  # (every, rounds): this stage evaluates after those steps (runtime/stage/evaluate.py)
    if welcome.stage_eval_every and k in plan.pipelines[0].stages:
        stage_eval = (welcome.stage_eval_every, welcome.stage_eval_rounds or 1)
    train_steps(executor, mailbox, plan.input_hash, welcome.start_step, eval_every=welcome.eval_every or 0,
                rebuild=rebuild, stage_eval=stage_eval)
    stop = record_of(mailbox.recv("stop", sender=COORDINATOR, timeout_s=None), Stop)
    if stop.plan is not None and stop.replan is not None:  # lost a device after the last step: go on there
        raise StopRequested(stop.reason or "stop requested", stop.plan, stop.replan)
    log.info("stopping: %s", stop.reason or "stop requested")


def _follow_welcome(plan: Plan, welcome: Welcome, mailbox: Mailbox, heartbeat: Heartbeat) -> Plan:
    """Take the welcome's failure bound (for the coordinator's silence and our beats) and training settings."""
    failure_timeout_s = float(welcome.failure_timeout_s if welcome.failure_timeout_s is not None else FAILURE_TIMEOUT_S)
    mailbox.last_seen[COORDINATOR] = time.monotonic()
    mailbox.silence_s = failure_timeout_s
    heartbeat.interval_s = heartbeat_interval(failure_timeout_s)
    return replace(plan, train=apply_train_settings(plan.train, welcome.train))


def _build(plan: Plan, k: int, device: Any, mailbox: Mailbox, neighbours: tuple[int | None, int | None]) -> Any:
    """Build stage k (its weights, quantized, with LoRA) and its executor; tell the coordinator it started."""
    from hetero.runtime.stage.executor import Executor
    from hetero.runtime.stage.lora import peft_key
    from hetero.runtime.stage.model import build_stage

    t0 = time.perf_counter()
    if plan.stages[k].chunks:
        return _build_chunks(plan, k, device, mailbox, t0)
    stage = build_stage(plan, k, device)
    prev = neighbours[0]
    links = (plan.stages[prev].compress_out if prev is not None else "none", plan.stages[k].compress_out)
    names = tuple(plan.stage_id(j) if j is not None else None for j in neighbours)
    executor = Executor(stage, plan.stages[k].actions(), mailbox, plan.train, names,  # type: ignore[arg-type]
                        replicated=len(plan.pipelines) > 1, compression=links)
    n_lora = sum(p.numel() for p in executor.params)
    log.info("stage %d built in %.1f s: layers %s, %d LoRA parameters", k, time.perf_counter() - t0,
             stage.layout.layers, n_lora)
    keys = [peft_key(n) for n, _ in stage.lora_named_parameters()]
    mailbox.transport.send(COORDINATOR, Start(stage=k, build_s=time.perf_counter() - t0, lora_params=n_lora,
                                              keys=keys))
    return executor


def _build_chunks(plan: Plan, k: int, device: Any, mailbox: Mailbox, t0: float) -> Any:
    """Stage k's chunks under an interleaved schedule (runtime/stage/chunks.py), and its executor."""
    from hetero.runtime.stage.chunks import ChunkedExecutor
    from hetero.runtime.stage.lora import peft_key
    from hetero.runtime.stage.model import build_chunks

    stages = build_chunks(plan, k, device)
    executor = ChunkedExecutor(stages, plan.stages[k].actions(), mailbox, plan.train, k,  # type: ignore[arg-type]
                               len(plan.stages), names=plan.stage_id, compress=[s.compress_out for s in plan.stages])
    n_lora = sum(p.numel() for ex in executor.executors for p in ex.params)
    log.info("stage %d built in %.1f s: chunks of layers %s, %d LoRA parameters", k, time.perf_counter() - t0,
             [s.layout.layers for s in stages], n_lora)
    keys = [peft_key(n) for s in stages for n, _ in s.lora_named_parameters()]
    mailbox.transport.send(COORDINATOR, Start(stage=k, build_s=time.perf_counter() - t0, lora_params=n_lora,
                                              keys=keys))
    return executor


def _restore(executor: Any, mailbox: Mailbox, k: int) -> None:
    """A resumed run: the coordinator's ``state`` for this stage (LoRA, AdamW, step count)."""
    from hetero.runtime.stage.state import restore_stage

    state = _await_state(mailbox, 600.0)
    restore_stage(executor, state.tensors, state.meta)
    log.info("stage %d resumed after step %d", k, executor.steps_done)


def _await_state(mailbox: Mailbox, timeout_s: float) -> Any:
    """The coordinator's ``state``. The coordinator sends it once: if this stage's rules dropped it (a tensor of
    another dtype), say why at once rather than wait out ``timeout_s``."""
    transport = mailbox.transport
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return mailbox.recv("state", sender=COORDINATOR, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        except WireError as exc:
            if not is_timeout(exc) or time.monotonic() >= deadline:
                raise
        # Only a drop of what the coordinator itself sent (a forgery from another key proves nothing).
        for peer, why in transport.rejections:
            if "'state'" in why and f"from {COORDINATOR}" in why and (peer == COORDINATOR or transport.identity is None):
                raise WireError(f"the coordinator's state for this stage was refused: {why}")


def _report_failure(transport: Any, k: int, exc: Exception) -> int:
    """Tell the coordinator (one line) and stderr why stage k failed; returns the exit code."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if not isinstance(exc, HeteroError):
        line = f"{type(exc).__name__}: {line}"
    log.error("stage %d failed: %s\n%s", k, line, traceback.format_exc())
    try:
        transport.send(COORDINATOR, Error(stage=k, message=line))
    except Exception:
        pass
    print(f"hetero: error: stage {k}: {line}", file=sys.stderr, flush=True)
    return 2 if isinstance(exc, HeteroError) else 1


def train_steps(executor: Any, mailbox: Mailbox, plan_hash: str, start_step: int, eval_every: int = 0,
                rebuild: Callable[[Any], Any] | None = None, stage_eval: tuple[int, int] | None = None) -> None:
    """Steps ``start_step``.. of the run: ``stepdone`` after each, ``checkpoint`` when due, after the last,
    and every ``eval_every`` steps (the coordinator hands the adapter to the evaluator); after a step whose
    clip came with a ``rebalance``, the move (``rebuild`` builds the stage on its new span).

    Also answers the coordinator's checkpoint request (Ctrl-C on `hetero run`) from wherever it waits.
    """
    from hetero.runtime.base.payloads import payload_due, stage_eval_due
    from hetero.runtime.stage.state import stage_payload

    train, transport = executor.train, mailbox.transport
    current = [executor]  # the executor of the stage's current span (a rebalance replaces it)

    def checkpoint_on_request(done: int) -> None:
        # The coordinator sends no clip for step `done`: this stage's state stays the one after `done`
        # steps until the final stop, wherever the program is blocked.
        if current[0].steps_done != done:
            raise WireError(f"the coordinator asked for a checkpoint after step {done}, this stage has done "
                            f"{current[0].steps_done}")
        tensors, meta = stage_payload(current[0], plan_hash)
        transport.send(COORDINATOR, "checkpoint", step=done - 1, tensors=tensors, meta=meta)
        log.info("checkpoint after step %d sent on request; waiting for stop", done)

    mailbox.on_checkpoint = checkpoint_on_request
    for step in range(start_step, train.steps):
        if transport.rules is not None:
            transport.rules.step = step  # from now on, messages of other steps than this and the next are dropped
        stats = current[0].run_step(step)
        transport.send(COORDINATOR, StepDone(**stats.to_meta()), step=step)
        log.info("step %d: busy %.3f s of %.3f s", step, stats.busy_s, stats.wall_s)
        if stage_eval is not None and stage_eval_due(stage_eval[0], train.steps, step):
            from hetero.runtime.stage.evaluate import evaluate_round

            took = sum(evaluate_round(current[0], step, r) for r in range(stage_eval[1]))
            log.info("evaluation after step %d: %d round(s) in %.3f s", step, stage_eval[1], took)
        due = payload_due(train, eval_every, step) or _snapshot_after(transport, step)
        if due:
            tensors, meta = stage_payload(current[0], plan_hash)
            transport.send(COORDINATOR, "checkpoint", step=step, tensors=tensors, meta=meta)
        move = _rebalance_after(transport, step)
        if move is not None and rebuild is not None:
            current[0] = _move(current[0], move, rebuild, mailbox, plan_hash, step, sent=due)


def _snapshot_after(transport: Any, step: int) -> bool:
    """Whether the coordinator asked for this stage's state after ``step`` (a snapshot: it came before the step's
    clip, so it is here now)."""
    try:
        transport.recv("snapshot", step=step, sender=COORDINATOR, timeout_s=0)
    except WireError as exc:
        if is_timeout(exc):
            return False
        raise
    return True


def _rebalance_after(transport: Any, step: int) -> Any:
    """The coordinator's ``rebalance`` for after ``step`` if it came (before the step's clip, so it is here now)."""
    try:
        msg = transport.recv("rebalance", step=step, sender=COORDINATOR, timeout_s=0)
    except WireError as exc:
        if is_timeout(exc):
            return None
        raise
    return Rebalance.from_wire(msg.meta, "rebalance")


def _move(executor: Any, move: Any, rebuild: Callable[[Any], Any], mailbox: Mailbox, plan_hash: str, step: int,
          sent: bool) -> Any:
    """Send this stage's state (unless just sent), drop its layers, build the new span, take its state."""
    import gc

    from hetero.runtime.stage.state import stage_payload

    if not sent:
        tensors, meta = stage_payload(executor, plan_hash)
        mailbox.transport.send(COORDINATOR, "checkpoint", step=step, tensors=tensors, meta=meta)
    log.info("rebalance after step %d: %s", step, move.reason)
    k = executor.stage.index
    executor.stage = executor.params = executor.optimizer = None  # the old layers go before the new ones load
    del executor
    gc.collect()
    rebuilt = rebuild(move)
    _restore(rebuilt, mailbox, k)
    return rebuilt


def serve_stage(plan_path: Path, plan: Plan, k: int, coordinator: str, parent_pid: int | None = None,
                replan_dir: Path | None = None) -> int:
    """Run stage k of the plan at ``plan_path`` in this process, logging to stderr; returns the exit code."""
    from hetero.runtime.base.processes import raise_open_file_limit

    raise_open_file_limit()  # before the inbox listens: a flood of idle connections must not exhaust it
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack to the log
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s stage{k} %(levelname)s %(message)s")
    if not 0 <= k < len(plan.stages):
        raise PlanError(f"--stage {k}: the plan has stages 0..{len(plan.stages) - 1}")
    return run_stage(plan, k, coordinator, parent_pid, key_dirs(plan_path, plan.stages[k].host), replan_dir)


def main_stage(argv: list[str]) -> int:
    """``python -m hetero.runtime.stage.process PLAN --stage k --coordinator tcp://.. [--parent-pid P]``."""
    ap = argparse.ArgumentParser(prog="hetero stage", description="Run one stage of a plan (started by "
                                 "`hetero run` or `hetero worker --host`).")
    ap.add_argument("plan", type=Path)
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--coordinator", required=True, help="tcp://ADDRESS:PORT of `hetero run`")
    ap.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    ap.add_argument("--replan-dir", type=Path, help="where a stop with the run's next plan leaves it (hetero worker)")
    args = ap.parse_args(argv)
    return serve_stage(args.plan, Plan.load(args.plan), args.stage, args.coordinator, args.parent_pid,
                       args.replan_dir)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown of torch & co. (seconds on a busy host; nothing is left to save):
    a run's failure bound counts until its stages are gone."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_stage(argv: list[str]) -> None:
    """Run ``main_stage(argv)`` as this whole process and end it with the stage's exit code (never returns)."""
    try:
        _exit_now(main_stage(argv))
    except HeteroError as exc:
        print(f"hetero: error: {exc}", file=sys.stderr)
        _exit_now(2)
    except KeyboardInterrupt:
        _exit_now(130)


if __name__ == "__main__":
    exit_stage(sys.argv[1:])
