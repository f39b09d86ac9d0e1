"""A stage process (``python -m hetero.runtime.worker plan.json --stage k``) and a host's launcher
(``hetero worker plan.json --host NAME``: one process per device of that host).

Life of a stage: hello (plan hash, wire version, environment) -> welcome (run settings, incl. the
`hetero run` overrides) -> build the stage -> ready -> steps (the executor) with a checkpoint message
whenever due -> final checkpoint -> wait for stop. It never outlives the run: it exits on ``stop``,
when the coordinator's heartbeats stop, when its parent process dies, or on any error (reported to
the coordinator as one ``error`` line; the traceback goes to the stage's log).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import subprocess
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
from hetero.serde import from_dict, to_dict
from hetero.specs import TrainSpec

COORDINATOR = "coordinator"
HEARTBEAT_S = 2.0  # how often each side says it is alive
SLICE_S = 0.5  # a blocking receive wakes up this often to look at control messages
log = logging.getLogger("hetero.worker")


class StopRequested(Exception):
    """The coordinator asked this process to stop (normal end, Ctrl-C, or another stage failed)."""


def is_timeout(exc: WireError) -> bool:
    """Whether a transport error is a receive timeout (as opposed to a bad or foreign message)."""
    return type(exc).__name__ == "RecvTimeout" or str(exc).startswith("no ")


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


class Mailbox:
    """A Transport whose blocking receives also watch the control plane.

    While waiting it notices ``stop`` (raises StopRequested), ``error`` from a peer, and silence of
    the peers it watches (no heartbeat for ``silence_s``), so no process hangs on a dead run.
    """

    def __init__(self, transport: Any, watch: dict[str, float] | None = None, silence_s: float = 60.0,
                 on_idle: Any = None) -> None:
        self.transport = transport
        self.last_seen = dict(watch or {})  # peer -> monotonic time it was last heard from
        self.silence_s = silence_s
        self.on_idle = on_idle  # called every slice (the coordinator checks its child processes)

    def send(self, peer: str, kind: str, **kwargs: Any) -> None:
        self.transport.send(peer, kind, **kwargs)

    def _take(self, kind: str) -> Any:
        try:
            return self.transport.recv(kind, timeout_s=0)
        except WireError as exc:
            if is_timeout(exc):
                return None
            raise

    def poll_control(self) -> None:
        """Handle control messages that arrived so far; raise if the run must end."""
        now = time.monotonic()
        while (msg := self._take("heartbeat")) is not None:
            self.last_seen[msg.sender] = now
        if (msg := self._take("stop")) is not None:
            raise StopRequested(str(msg.meta.get("reason", "stop requested")))
        if (msg := self._take("error")) is not None:
            raise PeerError(msg.sender, str(msg.meta.get("message", "failed")))
        for peer, seen in self.last_seen.items():
            if now - seen > self.silence_s:
                raise WireError(f"{peer} has been silent for {now - seen:.0f} s (no heartbeat): it died or the network is down")
        if self.on_idle is not None:
            self.on_idle()

    def recv(self, kind: str | None = None, *, step: int | None = None, mb: int | None = None,
             sender: str | None = None, timeout_s: float | None = None) -> Any:
        """Like Transport.recv, but wakes up every SLICE_S to run poll_control()."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.poll_control()
            try:
                msg = self.transport.recv(kind, step=step, mb=mb, sender=sender, timeout_s=SLICE_S)
            except WireError as exc:
                if not is_timeout(exc):
                    raise
                if deadline is not None and time.monotonic() > deadline:
                    what = f"{kind!r} step {step}" + (f" mb {mb}" if mb is not None and mb >= 0 else "")
                    raise WireError(f"no {what} from {sender or 'any peer'} within {timeout_s:g} s") from None
                continue
            if msg.sender in self.last_seen:
                self.last_seen[msg.sender] = time.monotonic()
            return msg


class PeerError(HeteroError):
    """Another process of the run reported a failure."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"{peer} failed: {message}")
        self.peer = peer


class Heartbeat(threading.Thread):
    """Sends ``heartbeat`` to peers every HEARTBEAT_S; exits the process if its parent dies."""

    def __init__(self, transport: Any, peers: list[str], parent_pid: int | None = None) -> None:
        super().__init__(daemon=True, name="heartbeat")
        self.transport, self.peers, self.parent_pid = transport, peers, parent_pid
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.error("parent process %d is gone: exiting", self.parent_pid)
                os._exit(3)  # the main thread may be blocked inside torch; nothing to save
            for peer in self.peers:
                try:
                    self.transport.send(peer, "heartbeat")
                except Exception as exc:
                    if getattr(self.transport, "_closed", False):
                        return  # shutting down: nothing left to tell
                    log.warning("heartbeat to %s failed: %s", peer, exc)  # keep beating: one failure is no death


def drop_unsent(transport: Any, linger_ms: int = 0) -> None:
    """Make close() drop, after ``linger_ms``, what peers that already exited will never take."""
    import zmq

    # Transport has no close(linger=...) yet; its sockets are plain pyzmq sockets.
    for sock in getattr(transport, "_peers", {}).values():
        sock.setsockopt(zmq.LINGER, linger_ms)


def apply_train_settings(train: TrainSpec, settings: dict[str, Any]) -> TrainSpec:
    """The plan's TrainSpec with the coordinator's run-time values (validated like plan.json)."""
    merged = {**to_dict(train), **settings}
    return from_dict(TrainSpec, merged, "welcome.train", WireError)


def run_stage(plan: Plan, k: int, coordinator: str, parent_pid: int | None = None) -> int:
    """Run stage k until the coordinator says stop; returns the process exit code."""
    # Import the heavy libraries before hello: once the coordinator watches our heartbeats, a long
    # import holding the import lock or the GIL must not look like a dead stage.
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from hetero.runtime.checkpoint import peft_key, restore_stage, stage_payload
    from hetero.runtime.env import describe_environment
    from hetero.runtime.executor import Executor, stage_name
    from hetero.runtime.stage import build_stage
    from hetero.runtime.transport import Transport
    from hetero.runtime.wire import WIRE_VERSION

    sp = plan.stages[k]
    device = device_for(plan, k)
    if device.type == "cpu":
        torch.set_num_threads(max(1, sp.threads or 1))
    transport = Transport(stage_name(k), sp.endpoint, plan.input_hash, recv_timeout_s=300.0)
    heartbeat: Heartbeat | None = None
    stopped = False  # after a stop nothing is left to deliver: close without lingering on dead peers
    try:
        transport.connect(COORDINATOR, coordinator)
        if k > 0:
            transport.connect(stage_name(k - 1), plan.stages[k - 1].endpoint)
        if k < len(plan.stages) - 1:
            transport.connect(stage_name(k + 1), plan.stages[k + 1].endpoint)
        heartbeat = Heartbeat(transport, [COORDINATOR], parent_pid)
        heartbeat.start()
        transport.send(COORDINATOR, "hello", meta={
            "stage": k, "input_hash": plan.input_hash, "wire_version": WIRE_VERSION,
            "env": describe_environment(str(device)),
        })
        mailbox = Mailbox(transport)
        log.info("stage %d on %s: hello sent to %s", k, device, coordinator)
        welcome = mailbox.recv("welcome", sender=COORDINATOR, timeout_s=600.0)
        mailbox.last_seen[COORDINATOR] = time.monotonic()
        mailbox.silence_s = float(welcome.meta.get("silence_s", 60.0))
        train = apply_train_settings(plan.train, welcome.meta.get("train", {}))
        plan = replace(plan, train=train)
        t0 = time.perf_counter()
        stage = build_stage(plan, k, device)
        executor = Executor(stage, parse_program(sp.program), mailbox, train)
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
        for step in range(int(welcome.meta.get("start_step", 0)), train.steps):
            stats = executor.run_step(step)
            transport.send(COORDINATOR, "stepdone", step=step, meta=stats.to_meta())
            log.info("step %d: busy %.3f s of %.3f s", step, stats.busy_s, stats.wall_s)
            due = train.checkpoint_every > 0 and (step + 1) % train.checkpoint_every == 0
            if due or step + 1 == train.steps:
                tensors, meta = stage_payload(executor, plan.input_hash)
                transport.send(COORDINATOR, "checkpoint", step=step, tensors=tensors, meta=meta)
        stop = mailbox.recv("stop", sender=COORDINATOR, timeout_s=None)
        log.info("stopping: %s", stop.meta.get("reason", "stop requested"))
        stopped = True
    except StopRequested as stop:
        log.info("stopping: %s", stop)
        stopped = True
        return 0
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
        return 2 if isinstance(exc, HeteroError) else 1
    finally:
        if heartbeat is not None:
            heartbeat.stopped.set()
        if stopped:
            drop_unsent(transport)
        transport.close()
        log.info("stage %d: transport closed", k)
    return 0


def serve_host(plan_path: Path, plan: Plan, host: str, run_dir: Path, coordinator: str) -> int:
    """Start every stage of ``host`` (one process per device) and wait for them; returns an exit code."""
    stages = [s.index for s in plan.stages if s.host == host]
    if not stages:
        hosts = sorted({s.host for s in plan.stages})
        raise PlanError(f"host '{host}' runs no stage of this plan; its stages run on: {', '.join(hosts)}")
    procs = spawn_stages(plan_path, stages, run_dir, coordinator)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM: stop the stages in order, like Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    print(f"hetero worker: host {host} runs stages {stages} (logs in {run_dir / 'logs'}); coordinator {coordinator}",
          flush=True)
    try:
        codes = {k: p.wait() for k, p in procs.items()}
    except KeyboardInterrupt:
        stop_processes(procs)
        raise
    bad = {k: c for k, c in codes.items() if c != 0}
    if bad:
        k, code = next(iter(bad.items()))
        print(f"hetero: error: stage {k} exited with code {code}; see {run_dir / 'logs' / f'stage{k}.log'}",
              file=sys.stderr)
        return 1
    return 0


def spawn_stages(plan_path: Path, stages: list[int], run_dir: Path, coordinator: str) -> dict[int, subprocess.Popen]:
    """One ``python -m hetero.runtime.worker`` per stage, logging to run_dir/logs/stage<k>.log."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    procs: dict[int, subprocess.Popen] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in stages:
        with open(run_dir / "logs" / f"stage{k}.log", "ab") as logf:
            # start_new_session: a terminal Ctrl-C reaches only the parent, which stops stages in order.
            procs[k] = subprocess.Popen(
                [sys.executable, "-m", "hetero.runtime.worker", str(plan_path), "--stage", str(k),
                 "--coordinator", coordinator, "--parent-pid", str(os.getpid())],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return procs


def stop_processes(procs: dict[int, subprocess.Popen], grace_s: float = 10.0) -> None:
    """Wait up to grace_s for stage processes to exit, then terminate, then kill the stragglers."""
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetero worker", description="Run this host's stages of a plan.")
    ap.add_argument("plan", type=Path)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--host", help="run every stage the plan places on this host")
    group.add_argument("--stage", type=int, help="run one stage (what --host starts per device)")
    ap.add_argument("--coordinator", help="tcp://ADDRESS:PORT of `hetero run` (default: stage 0's host, base port - 1)")
    ap.add_argument("--run-dir", type=Path, help="where this host writes its stage logs (default runs/worker-<host>-<time>)")
    ap.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    return ap


def main_worker(argv: list[str]) -> int:
    """`hetero worker plan.json --host NAME` (or --stage k): serve this host's stages of a plan."""
    args = _parser().parse_args(argv)
    plan = Plan.load(args.plan)
    coordinator = args.coordinator or coordinator_endpoint(plan)
    if args.stage is not None:
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack to the log
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s stage{args.stage} %(levelname)s %(message)s")
        if not 0 <= args.stage < len(plan.stages):
            raise PlanError(f"--stage {args.stage}: the plan has stages 0..{len(plan.stages) - 1}")
        return run_stage(plan, args.stage, coordinator, args.parent_pid)
    run_dir = args.run_dir or Path("runs") / f"worker-{args.host}-{time.strftime('%Y%m%d-%H%M%S')}"
    return serve_host(args.plan, plan, args.host, run_dir, coordinator)


if __name__ == "__main__":
    try:
        sys.exit(main_worker(sys.argv[1:]))
    except HeteroError as exc:
        print(f"hetero: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
