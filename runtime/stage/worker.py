"""A stage process (``python -m hetero.runtime.stage.worker plan.json --stage k``) and a host's launcher
(``hetero worker plan.json --host NAME``: one process per device of that host).

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
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError, PlanError, WireError
from hetero.plan import Plan
from hetero.program import parse_program
from hetero.runtime.run.processes import spawn_stages, stop_processes, supervise
from hetero.runtime.wire.control import (
    FAILURE_TIMEOUT_S,
    Heartbeat,
    Mailbox,
    PeerLost,
    StopRequested,
    drop_unsent,
    heartbeat_interval,
    is_timeout,
)
from hetero.security import COORDINATOR, key_dirs, load_identity
from hetero.serde import from_dict, to_dict
from hetero.specs import TrainSpec

log = logging.getLogger("hetero.worker")


def coordinator_endpoint(plan: Plan, host: str | None = None, port: int | None = None) -> str:
    """Where the coordinator listens: stage 0's host (or ``host``), on its base port - 1 unless given."""
    name = host or plan.stages[0].host
    try:
        spec = plan.cluster.host(name)
    except KeyError:
        raise PlanError(f"host '{name}' is not in the plan; hosts: {', '.join(h.name for h in plan.cluster.hosts)}") from None
    return f"tcp://{spec.address}:{port if port is not None else spec.port - 1}"


def device_for(plan: Plan, k: int) -> Any:
    """The torch device of stage k on this host (ROCm builds of torch also call it 'cuda')."""
    import torch

    sp = plan.stages[k]
    if sp.backend == "cpu":
        return torch.device("cpu")
    index = plan.cluster.device(sp.device).index
    if sp.backend in ("cuda", "rocm"):
        if not torch.cuda.is_available():
            raise PlanError(f"stage {k} runs on {sp.device} ({sp.backend}) but this torch sees no GPU here")
        return torch.device("cuda", index)
    if sp.backend == "mps":
        return torch.device("mps")
    raise PlanError(f"stage {k}: unknown backend '{sp.backend}'")


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
    from hetero.runtime.stage.executor import stage_name
    from hetero.runtime.wire.rules import max_message_bytes, stage_rules
    from hetero.runtime.wire.transport import Transport
    from hetero.security import load_identity

    identity = load_identity(plan.security, stage_name(k), keys)
    return Transport(stage_name(k), plan.stages[k].endpoint, plan.input_hash, recv_timeout_s=300.0,
                     identity=identity, peer_keys=plan.security.public_keys,
                     max_message_bytes=max_message_bytes(plan, k), rules=stage_rules(plan, k))


def run_stage(plan: Plan, k: int, coordinator: str, parent_pid: int | None = None,
              keys: list[Path] | None = None) -> int:
    """Run stage k until the coordinator says stop; returns the process exit code."""
    # Import the heavy libraries before hello: once the coordinator watches our heartbeats, a long
    # import holding the import lock or the GIL must not look like a dead stage.
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from hetero.runtime.run.checkpoint import peft_key, restore_stage
    from hetero.runtime.run.env import describe_environment
    from hetero.runtime.stage.executor import Executor, stage_name
    from hetero.runtime.stage.model import build_stage
    from hetero.runtime.wire.frames import WIRE_VERSION

    sp = plan.stages[k]
    device = device_for(plan, k)
    if device.type == "cpu":
        torch.set_num_threads(max(1, sp.threads or 1))
    transport = stage_transport(plan, k, keys or [])
    heartbeat: Heartbeat | None = None
    linger_ms: int | None = None  # None: close() flushes what is queued (CLOSE_LINGER_S at most per peer)
    try:
        transport.connect(COORDINATOR, coordinator)
        neighbours = (plan.prev_stage(k), plan.next_stage(k))  # within k's pipeline replica
        for j in neighbours:
            if j is not None:
                transport.connect(stage_name(j), plan.stages[j].endpoint)
        # The heartbeat thread also ends this process if the coordinator's connection drops for good,
        # even while this thread is busy building the stage.
        heartbeat = Heartbeat(transport, [COORDINATOR], parent_pid, watch=[COORDINATOR])
        heartbeat.start()
        transport.send(COORDINATOR, "hello", meta={
            "stage": k, "input_hash": plan.input_hash, "wire_version": WIRE_VERSION, "pid": os.getpid(),
            "env": describe_environment(str(device)),
        })
        mailbox = Mailbox(transport)
        log.info("stage %d on %s: hello sent to %s", k, device, coordinator)
        welcome = await_welcome(mailbox, transport, plan, 600.0)
        failure_timeout_s = float(welcome.meta.get("failure_timeout_s", FAILURE_TIMEOUT_S))
        mailbox.last_seen[COORDINATOR] = time.monotonic()
        mailbox.silence_s = failure_timeout_s
        heartbeat.interval_s = heartbeat_interval(failure_timeout_s)
        train = apply_train_settings(plan.train, welcome.meta.get("train", {}))
        plan = replace(plan, train=train)
        t0 = time.perf_counter()
        stage = build_stage(plan, k, device)
        executor = Executor(stage, parse_program(sp.program), mailbox, train, neighbours,
                            replicated=len(plan.pipelines) > 1)
        n_lora = sum(p.numel() for p in executor.params)
        log.info("stage %d built in %.1f s: layers %s, %d LoRA parameters", k, time.perf_counter() - t0,
                 stage.layout.layers, n_lora)
        keys = [peft_key(n) for n, _ in stage.lora_named_parameters()]
        transport.send(COORDINATOR, "start", meta={"stage": k, "build_s": time.perf_counter() - t0,
                                                   "lora_params": n_lora, "keys": keys})
        if welcome.meta.get("resume"):
            state = mailbox.recv("state", sender=COORDINATOR, timeout_s=600.0)
            restore_stage(executor, state.tensors, state.meta)
            log.info("stage %d resumed after step %d", k, executor.steps_done)
        train_steps(executor, mailbox, plan.input_hash, int(welcome.meta.get("start_step", 0)),
                    eval_every=int(welcome.meta.get("eval_every", 0)))
        stop = mailbox.recv("stop", sender=COORDINATOR, timeout_s=None)
        log.info("stopping: %s", stop.meta.get("reason", "stop requested"))
        linger_ms = 0  # after a stop nothing is left to deliver: do not linger on dead peers
    except StopRequested as stop:
        log.info("stopping: %s", stop)
        linger_ms = 0
        return 0
    except PeerLost as lost:  # the coordinator is gone: nobody is left to tell
        log.error("stage %d: coordinator %s: exiting", k, lost.cause)
        print(f"hetero: error: stage {k}: the coordinator stopped answering ({lost.cause})", file=sys.stderr, flush=True)
        linger_ms = 0
        return 2
    except Exception as exc:  # report every failure to the coordinator as one line
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, HeteroError):
            line = f"{type(exc).__name__}: {line}"
        log.error("stage %d failed: %s\n%s", k, line, traceback.format_exc())
        try:
            transport.send(COORDINATOR, "error", meta={"stage": k, "message": line})
        except Exception:
            pass
        print(f"hetero: error: stage {k}: {line}", file=sys.stderr, flush=True)
        linger_ms = 2000  # time for the error line to reach a live coordinator, not for dead neighbours
        return 2 if isinstance(exc, HeteroError) else 1
    finally:
        if heartbeat is not None:
            heartbeat.finish()  # before close(): its connection monitor is a socket of the transport's context
        if linger_ms is not None:
            drop_unsent(transport, linger_ms)
        transport.close()
        log.info("stage %d: transport closed", k)
    return 0


def train_steps(executor: Any, mailbox: Mailbox, plan_hash: str, start_step: int, eval_every: int = 0) -> None:
    """Steps ``start_step``.. of the run: ``stepdone`` after each, ``checkpoint`` when due, after the last,
    and every ``eval_every`` steps (the coordinator hands the adapter to the evaluator).

    Also answers the coordinator's checkpoint request (Ctrl-C on `hetero run`) from wherever it waits.
    """
    from hetero.runtime.run.checkpoint import stage_payload

    train, transport = executor.train, mailbox.transport

    def checkpoint_on_request(done: int) -> None:
        # The coordinator sends no clip for step `done`: this stage's state stays the one after `done`
        # steps until the final stop, wherever the program is blocked.
        if executor.steps_done != done:
            raise WireError(f"the coordinator asked for a checkpoint after step {done}, this stage has done "
                            f"{executor.steps_done}")
        tensors, meta = stage_payload(executor, plan_hash)
        transport.send(COORDINATOR, "checkpoint", step=done - 1, tensors=tensors, meta=meta)
        log.info("checkpoint after step %d sent on request; waiting for stop", done)

    mailbox.on_checkpoint = checkpoint_on_request
    for step in range(start_step, train.steps):
        if transport.rules is not None:
            transport.rules.step = step  # from now on, messages of other steps than this and the next are dropped
        stats = executor.run_step(step)
        transport.send(COORDINATOR, "stepdone", step=step, meta=stats.to_meta())
        log.info("step %d: busy %.3f s of %.3f s", step, stats.busy_s, stats.wall_s)
        if payload_due(train, eval_every, step):
            tensors, meta = stage_payload(executor, plan_hash)
            transport.send(COORDINATOR, "checkpoint", step=step, tensors=tensors, meta=meta)


def payload_due(train: TrainSpec, eval_every: int, step: int) -> bool:
    """After ``step``, do the stages send their state (a checkpoint, the adapter for evaluation, the last)?"""
    done = step + 1
    return (done == train.steps or (train.checkpoint_every > 0 and done % train.checkpoint_every == 0)
            or (eval_every > 0 and done % eval_every == 0))


def check_host(plan_path: Path, plan: Plan, host: str) -> list[int]:
    """The stages ``host`` runs, once its keys are found; a one-line PlanError if it cannot run them."""
    stages = [s.index for s in plan.stages if s.host == host]
    if not stages:
        hosts = sorted({s.host for s in plan.stages})
        raise PlanError(f"host '{host}' runs no stage of this plan; its stages run on: {', '.join(hosts)}")
    for k in stages:  # every key this host needs, before any process starts
        load_identity(plan.security, f"stage{k}", key_dirs(plan_path, host))
    return stages


def _wait_for_eof(closed: threading.Event) -> None:
    """Set ``closed`` when stdin ends: `hetero run`'s ssh session is gone (or it stopped us on purpose)."""
    try:
        while os.read(0, 65536):
            pass
    except OSError:
        pass
    closed.set()


def serve_host(plan_path: Path, plan: Plan, host: str, run_dir: Path, coordinator: str,
               watch_stdin: bool = False) -> int:
    """Start every stage of ``host`` (one process per device) and wait for them; returns an exit code.

    ``watch_stdin``: also stop them when stdin closes (a worker that `hetero run` started over ssh)."""
    stages = check_host(plan_path, plan, host)
    procs = spawn_stages(plan_path, stages, run_dir, coordinator)
    closed = threading.Event()
    if watch_stdin:
        threading.Thread(target=_wait_for_eof, args=(closed,), daemon=True, name="stdin").start()

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM: stop the stages in order, like Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    print(f"hetero worker: host {host} runs stages {stages} (logs in {run_dir / 'logs'}); coordinator {coordinator}",
          flush=True)
    try:
        codes = supervise(procs, until=closed)
    except KeyboardInterrupt:
        stop_processes(procs)
        raise
    if len(codes) < len(procs):  # stdin closed first: the run is over or its coordinator is gone
        try:  # the ssh session that reads this may be gone
            print(f"hetero worker: stdin closed (`hetero run` ended or its ssh session dropped): stopping stages "
                  f"{[k for k in stages if k not in codes]}", flush=True)
        except OSError:
            pass
        stop_processes(procs, grace_s=3.0)
        return 0
    bad = {k: c for k, c in codes.items() if c != 0}
    if bad:
        k, code = next(iter(bad.items()))
        print(f"hetero: error: stage {k} exited with code {code}; see {run_dir / 'logs' / f'stage{k}.log'}",
              file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetero worker", description="Run this host's stages of a plan.")
    ap.add_argument("plan", type=Path)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--host", help="run every stage the plan places on this host")
    group.add_argument("--stage", type=int, help="run one stage (what --host starts per device)")
    ap.add_argument("--coordinator", help="tcp://ADDRESS:PORT of `hetero run` (default: stage 0's host, base port - 1)")
    ap.add_argument("--run-dir", type=Path, help="where this host writes its stage logs (default runs/worker-<host>-<time>)")
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true",
                    help="with --host: print one line (hetero's version, the plan's hash, or what is missing) and exit; "
                         "`hetero run` asks this of the hosts it starts over ssh")
    ap.add_argument("--watch-stdin", action="store_true",
                    help="with --host: stop this host's stages when stdin closes (how `hetero run` ends workers it "
                         "started over ssh)")
    return ap


def main_worker(argv: list[str]) -> int:
    """`hetero worker plan.json --host NAME` (or --stage k): serve this host's stages of a plan."""
    args = _parser().parse_args(argv)
    if args.check:
        if args.host is None:
            raise PlanError("--check goes with --host NAME")
        from hetero.runtime.run.ssh import check_report

        print(check_report(args.plan, args.host), flush=True)
        return 0
    plan = Plan.load(args.plan)
    coordinator = args.coordinator or coordinator_endpoint(plan)
    if args.stage is not None:
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack to the log
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s stage{args.stage} %(levelname)s %(message)s")
        if not 0 <= args.stage < len(plan.stages):
            raise PlanError(f"--stage {args.stage}: the plan has stages 0..{len(plan.stages) - 1}")
        return run_stage(plan, args.stage, coordinator, args.parent_pid,
                         key_dirs(args.plan, plan.stages[args.stage].host))
    check_host(args.plan, plan, args.host)  # before the run directory exists
    run_dir = args.run_dir or Path("runs") / f"worker-{args.host}-{time.strftime('%Y%m%d-%H%M%S')}"
    return serve_host(args.plan, plan, args.host, run_dir, coordinator, watch_stdin=args.watch_stdin)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown of torch & co. (seconds on a busy host; nothing is left to save):
    a run's failure bound counts until its stages are gone."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        _exit_now(main_worker(sys.argv[1:]))
    except HeteroError as exc:
        print(f"hetero: error: {exc}", file=sys.stderr)
        _exit_now(2)
    except KeyboardInterrupt:
        _exit_now(130)
