"""`hetero run`: the coordinator. Starts this host's stages, waits for remote ones, feeds data, clips, records.

Hosts with ssh settings in the fleet file are started (and stopped) over ssh: runtime/run/ssh.py.

Per optimizer step it sends the step's input ids to stage 0 and labels to the last stage, gathers
every stage's squared gradient norm, answers with the global clip coefficient (the math of
``clip_grad_norm_`` on one GPU: runtime/run/reduce.py), and writes one metrics.jsonl line from the
stages' ``stepdone``. Checkpoint messages become checkpoints/step-N/ files; the last one also becomes
adapter/ (runtime/run/records.py).

Failures end the run within ``failure_timeout_s``: a local stage that exits is seen at once (its exit
code or signal), a stage whose connection drops for good within LOST_GRACE_S, a silent one (hung,
stopped, its host unreachable) after ``failure_timeout_s`` without heartbeat; the error names the
stage, its host and pid, the cause, and the ``--resume`` command.

Ctrl-C or SIGTERM stops at the next step boundary with a checkpoint: the coordinator sends no more
data and no clip for the step in progress, so every stage's state stays the one after the last
completed step; it sends ``stop`` with ``checkpoint: N`` (N steps done), each stage answers with its
payload from wherever it is blocked, the coordinator writes checkpoints/step-N and sends the final
``stop``. A second Ctrl-C exits at once; `hetero run` still prints how to resume from the newest complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError, WireError
from hetero.plan import Plan
from hetero.planner.state_copy import copy_every
from hetero.protocol import (
    WIRE_VERSION,
    Clip,
    Labels,
    Record,
    Reduced,
    Snapshot,
    Stop,
    Welcome,
)
from hetero.runtime.base.processes import (
    LostStage,
    StageFailedError,
    exit_cause,
    is_stopped,
    last_error_line,
    raise_open_file_limit,
    spawn_stages,
    stop_processes,
)
from hetero.runtime.base.rundir import RunDirWriteError, run_command, write_run_file
from hetero.runtime.run.elastic import Rejoining
from hetero.runtime.run.handshake import HandshakeWatch, connect_stages
from hetero.runtime.run.moves import split_of
from hetero.runtime.run.options import RunOptions, coordinator_endpoint, step_timeout_hint, step_timeout_s
from hetero.runtime.run.records import ProgressBar, RunRecords, RunResult, metrics_line
from hetero.runtime.run.reduce import clip_coef, norm_from_sumsq, norm_of, sum_replica_grads
from hetero.runtime.run.run_profile import write_run_profile
from hetero.runtime.stage.state import checkpoint_due, payload_due
from hetero.runtime.wire.control import (
    Heartbeat,
    Mailbox,
    PeerError,
    PeerLost,
    StopRequested,
    drop_unsent,
    heartbeat_interval,
    is_timeout,
)
from hetero.security import COORDINATOR
from hetero.serde import to_dict

__all__ = ["Coordinator", "RunOptions", "RunResult", "StageFailedError", "coordinator_endpoint"]


log = logging.getLogger("hetero.run")

class Coordinator:
    """Drives one training run of a plan; see the module docstring."""

    def __init__(self, plan: Plan, plan_path: Path, options: RunOptions) -> None:
        from hetero.runtime.wire.transport import Transport

        raise_open_file_limit()  # before the inbox listens: a flood of idle connections must not exhaust it
        self.plan, self.plan_path, self.options = plan, plan_path, options
        self.run_dir = options.run_dir
        self.num_stages = len(plan.stages)
        self.host = options.host or plan.stages[0].host
        self.endpoint = coordinator_endpoint(plan, self.host, options.port)
        from hetero.runtime.wire.rules import coordinator_rules, max_message_bytes
        from hetero.security import install_keys, load_identity

        # This host's keys go to RUN_DIR/keys, where the local stages (started from RUN_DIR/plan.json) look.
        local_names = [COORDINATOR, *(plan.stage_id(s.index) for s in plan.stages if s.host == self.host)]
        install_keys(plan.security, local_names, [*options.key_dirs, self.run_dir / "keys"], self.run_dir / "keys")
        identity = load_identity(plan.security, COORDINATOR, [self.run_dir / "keys"])
        # This host's stages first: their keys are in place, and a failure below stops them.
        local = [s.index for s in plan.stages if s.host == self.host]
        launcher = options.launcher
        self.procs = (launcher.spawn(plan_path, local, self.run_dir, self.endpoint) if launcher is not None
                      else spawn_stages(plan_path, local, self.run_dir, self.endpoint))
        self.pids = {k: p.pid for k, p in self.procs.items()}  # stage -> pid (remote ones: from their hello)
        self.names = plan.stage_ids()
        try:
            self.transport = Transport(COORDINATOR, self.endpoint, plan.input_hash, recv_timeout_s=300.0,
                                       identity=identity, peer_keys=plan.security.public_keys,
                                       max_message_bytes=max_message_bytes(plan, None), rules=coordinator_rules(plan))
        except BaseException:
            stop_processes(self.procs, grace_s=0.0)
            raise
        try:
            connect_stages(self.transport, plan, self.names)  # watched from the first attempt (handshake.py)
            self.mailbox = Mailbox(self.transport, silence_s=options.failure_timeout_s, on_idle=self._check_children)
            # metrics, evaluations, checkpoints, adapter, TensorBoard (and W&B)
            self.records = RunRecords(plan, self.run_dir, wandb=options.wandb)
        except BaseException:
            stop_processes(self.procs, grace_s=0.0)
            self.transport.close()
            raise
        self.heartbeat = Heartbeat(self.transport, self.names, interval_s=heartbeat_interval(options.failure_timeout_s))
        self.greeting = HandshakeWatch(plan, self.transport, self.names, self.endpoint, plan_path,  # other plans
                                       earlier=set(options.earlier_plans))
        self.step_timeout_s = step_timeout_s(plan, options.step_timeout_s)
        self.snapshot_every_s = options.snapshot_every_s  # 0: no time-based checkpoints
        self.saved_at = time.perf_counter()  # when the stages' state last went to disk (or training began)
        # runtime.elastic=auto: the stages' state, copied off them every ``memory_every`` steps (runtime/run/elastic.py)
        self.elastic = options.elastic == "auto"
        self.memory: tuple[dict[str, Any], dict[str, Any]] | None = None  # the union of the newest payloads
        # Steps between copies: the first comes after one step (it protects the run early and is measured), the next
        # ones as far apart as what a copy measured against a step requires (the plan's prediction is shown only).
        self.memory_every = 1
        self.snapshot_to_disk = False
        self.result = self.records.result
        from hetero.runtime.run.moves import Mover

        self.mover = Mover(plan, options.rebalance, options.moves)
        self.start_step = 0  # > 0 when resuming from a checkpoint
        self.training = False  # between the first data sent and the last step: Ctrl-C means "checkpoint, then stop"
        self.trained = False  # training has begun: a failure's message says how to continue
        self.stop_signal: str | None = None  # the first SIGINT/SIGTERM received while training
        self.hung: set[int] = set()  # stages to kill rather than ask to stop
        self.ssh: Any = None  # runtime/run/ssh.py SshWorkers: the workers of the hosts started over ssh
        # runtime.elastic (runtime/run/elastic.py): called with a failure, returns how the run goes on (the next
        # plan, its path, the options) or None; ``recovered`` keeps its answer, for run_elastic.
        self.on_loss: Callable[[StageFailedError], tuple[Plan, Path, RunOptions] | None] | None = None
        self.recovered: tuple[Plan, Path, RunOptions] | None = None
        # ... and at a step boundary, whether a device that was lost is back (a Rejoining to go on with it, or None)
        self.on_return: Callable[[], Rejoining | None] | None = None
        self.rejected_seen = 0  # the transport's drop count when on_return last looked
        self.handed_over = False  # the run goes on under another plan: the ssh workers stay (they follow it)

    # -- lifecycle --------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Train for plan.train.steps steps; raises HeteroError (one line) when anything fails."""
        restore_signals: Callable[[], None] = lambda: None  # noqa: E731
        try:
            self._start_processes()
            self.heartbeat.start()
            restore_signals = self._catch_signals()
            self._run()
        except BaseException as exc:
            error = self._abort(exc)
            if error is not None:
                raise error from None
            raise
        finally:
            self._close(restore_signals)
        return self.result

    def _start_processes(self) -> None:
        """The evaluator, and which remote hosts to wait for (or start over ssh); this host's stages run already."""
        remote = sorted({s.host for s in self.plan.stages if s.host != self.host})
        self.records.open_evaluator(self.plan_path, self.host)
        if self.options.ssh_workers is not None:  # a re-planned run: the workers follow its plan (host.py)
            self.ssh = self.options.ssh_workers
            remote = [h for h in remote if h not in self.ssh.hosts]
        elif self.options.ssh_hosts:
            from hetero.runtime.run.ssh import SshWorkers

            self.ssh = SshWorkers(self.options.ssh_hosts, self.run_dir)
            remote = [h for h in remote if h not in self.ssh.hosts]
        if remote and self.options.recovery is not None:
            print(f"hetero run: waiting for hosts {', '.join(remote)}: their `hetero worker` starts its stages of "
                  f"{self.plan_path.name}", flush=True)
        elif remote:
            commands = "; ".join(f"on {h}: `hetero worker plan.json --host {h} --coordinator {self.endpoint}`"
                                 for h in remote)
            print(f"hetero run: waiting for hosts {', '.join(remote)}: start each with its copy of this plan.json, "
                  f"{commands}", flush=True)

    def _run(self) -> None:
        """Remote hosts started, handshake, training, last evaluation, and the final stop."""
        if self.ssh is not None and self.options.ssh_workers is None:
            self.ssh.start(self.endpoint)
            print(f"hetero run: started hosts {', '.join(self.ssh.hosts)} over ssh (their output: "
                  f"{self.run_dir / 'logs'}/host-NAME.log)", flush=True)
        # Tokenize while the stages import and build (before anyone watches for silence).
        batches = self.options.batches if self.options.batches is not None else self._batches()
        self._handshake()
        self._train(batches)
        self.records.finish_eval()
        self.heartbeat.stopped.set()  # nothing may queue behind the stop for stages about to exit
        interrupted = self.result.interrupted_after is not None
        self._broadcast(Stop(reason=f"{self.stop_signal}: checkpoint saved" if interrupted
                             else "training finished"))
        stop_processes(self.procs)
        if self.ssh is not None:
            self.ssh.wait(5.0)  # told to stop, the remote workers end on their own

    def _abort(self, exc: BaseException) -> HeteroError | None:
        """Stop every stage after ``exc``; returns the one-line error to raise instead (None: ``exc`` itself)."""
        if isinstance(exc, KeyboardInterrupt):
            self.heartbeat.stopped.set()
        else:  # heartbeats go on while the state is written and a re-plan is made: the stages left must not time out
            self._save_memory()  # before the error line: its resume command names the newest checkpoint
        error = self._explain(exc)
        reason = "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else f"run failed: {error or exc}"
        failed = error if error is not None else exc
        if self.on_loss is not None and isinstance(failed, StageFailedError):
            try:
                self.recovered = self.on_loss(failed)
            except Exception as why:  # a re-plan that fails ends the run with the loss's own line
                log.warning("runtime.elastic: could not re-plan: %s: %s", type(why).__name__, why)
                print(f"hetero run: runtime.elastic: could not re-plan ({type(why).__name__}: {why}): stopping",
                      file=sys.stderr, flush=True)
        self.heartbeat.stopped.set()  # nothing may queue behind the stop for stages about to exit
        if isinstance(exc, Rejoining):
            self._hand_over(exc.plan, exc.path, None, exc.joiners)
        elif self.recovered is not None:
            lost = failed.lost.stage if isinstance(failed, StageFailedError) and failed.lost is not None else None
            self._hand_over(self.recovered[0], self.recovered[1], lost)
        else:
            self._broadcast(Stop(reason=reason))
        stop_processes(self.procs, grace_s=3.0, kill_now=self.hung)
        # Dead stages never take what is queued for them: give live remote ones a second, not 10,
        # and the local ones (all gone now) nothing.
        drop_unsent(self.transport, linger_ms=1000)
        drop_unsent(self.transport, 0, [self.names[k] for k in self.procs])
        return error

    def _close(self, restore_signals: Callable[[], None]) -> None:
        """Whatever happened: the evaluator, the ssh workers, signal handlers, heartbeats, sockets."""
        self.records.close()
        if self.ssh is not None and not self.handed_over:
            self.ssh.stop()  # after the stop broadcast: each remote worker ends, or is ended
        restore_signals()
        self.heartbeat.finish()
        self.greeting.close()
        self.mailbox.close()  # its connection monitors first: the transport's context waits for them
        self.transport.close()

    def _catch_signals(self) -> Callable[[], None]:
        """SIGINT/SIGTERM while training: checkpoint at the next step boundary; returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, self._on_signal)

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

        return restore

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.training or self.stop_signal is not None:
            raise KeyboardInterrupt  # before training, or the second time: stop at once
        self.stop_signal = signal.Signals(signum).name
        print(f"hetero run: {self.stop_signal}: stopping after this step with a checkpoint "
              "(Ctrl-C again to quit at once, from the newest complete one)", file=sys.stderr, flush=True)

    def _save_memory(self) -> None:
        """The state copied off the stages (runtime.elastic), to disk as a snapshot when no checkpoint there is as new."""
        from hetero.runtime.base.rundir import checkpoint_step, latest_checkpoint

        if self.memory is None or int(self.memory[1]["step"]) <= 0:
            return
        newest = latest_checkpoint(self.run_dir)
        if newest is not None and checkpoint_step(newest) >= int(self.memory[1]["step"]):
            return
        try:
            self.records.write_state(self.memory)
        except HeteroError as exc:  # a full disk: the failure's own line says what to do
            log.warning("could not keep the run's state on disk: %s", exc)

    def _explain(self, exc: BaseException) -> HeteroError | None:
        """The one-line error for a failed run; None: re-raise ``exc`` as it is."""
        if isinstance(exc, RunDirWriteError):
            return exc.for_run(self.options.rerun)  # its resume command repeats this run's --host/--port
        if not isinstance(exc, (PeerError, PeerLost, StopRequested)):
            return None  # StageFailedError and the like are explained already; Ctrl-C and bugs pass
        try:
            self._check_children()  # a local stage that exited is the most precise cause
        except StageFailedError as dead:
            return dead
        k = self.names.index(exc.peer) if isinstance(exc, (PeerError, PeerLost)) and exc.peer in self.names else None
        if k is None:
            return StageFailedError(f"{exc} (logs: {self.run_dir / 'logs'})")
        if isinstance(exc, PeerError):
            return StageFailedError(self._failure_line(k, "failed", exc.message))
        cause = exc.cause
        if exc.silent:
            self.hung.add(k)
            if k in self.procs and is_stopped(self.procs[k].pid):
                cause = cause.replace("(hung or stopped?)", "(the process is stopped: SIGSTOP or Ctrl-Z?)")
        return StageFailedError(self._failure_line(k, "stopped responding", cause),
                                lost=LostStage(k, "stopped responding", cause))

    def _failure_line(self, k: int, what: str, cause: str) -> str:
        """``stage 1 exited on host h (pid 42): killed by SIGKILL; continue from step 4 with `...` (log: ...)``."""
        host = self.plan.stages[k].host
        pid = f" (pid {self.pids[k]})" if k in self.pids else ""
        log = str(self.run_dir / "logs" / f"stage{k}.log") if k in self.procs else f"on {host}, under `hetero worker`"
        if self.ssh is not None and host in self.ssh.hosts:
            log = f"on {host}, {self.ssh.remote_run_dir(host)}/logs/stage{k}.log"
        hint = f"; {self._resume_hint()}" if self.trained else ""
        return f"stage {k} {what} on host {host}{pid}: {cause}{hint} (log: {log})"

    def _command(self) -> str:
        """The `hetero run` command line that runs this plan again, in this run directory's copy."""
        return shlex.join(run_command(self.plan_path, self.options.rerun))

    def _resume_hint(self) -> str:
        from hetero.runtime.base.rundir import checkpoint_step, latest_checkpoint

        # The state copied off the stages goes to disk first, so that the line names it (it said "no checkpoint
        # yet" when the run stopped without recovering, though the copy was written a moment later).
        self._save_memory()
        last = latest_checkpoint(self.run_dir)
        if last is not None:
            return (f"continue from step {checkpoint_step(last)} with "
                    f"`{self._command()} --resume {shlex.quote(str(self.run_dir))}`")
        if self.options.resume is not None:
            return (f"no newer checkpoint: continue with `{self._command()} --resume "
                    f"{shlex.quote(str(self.options.resume))} --run-dir {shlex.quote(str(self.run_dir))}`")
        return (f"no checkpoint yet (one is written after every runtime.snapshot_every_s={self.snapshot_every_s:g} s of "
                f"training, and every train.checkpoint_every steps): start again with "
                f"`{self._command()} --run-dir {shlex.quote(str(self.run_dir))}`")

    def _hand_over(self, plan: Plan, path: Path, lost: int | None, joiners: Sequence[Any] = ()) -> None:
        """Stop every stage; the remote ones that are left, and the stages of devices that came back (``joiners``,
        elastic.Joiner: told under the plan they run), learn the plan the run goes on under: their `hetero worker`
        starts its stages of it (runtime/run/host.py). This host's stages are restarted by run_elastic."""
        self.handed_over = True
        number = int(path.stem.rsplit("-", 1)[-1])
        text = path.read_text()
        follow = Stop(reason=f"the run goes on under {path.name}", plan=text, replan=number)
        for k, name in enumerate(self.names):
            remote = self.plan.stages[k].host != self.host and k != lost
            try:
                self.transport.send(name, follow if remote else Stop(reason=f"the run goes on under {path.name}"))
            except Exception:  # best effort: a stage that misses it ends on the coordinator's silence
                pass
        for joiner in joiners:
            try:
                self.transport.connect(joiner.name, joiner.endpoint)
                self.transport.send(joiner.name, follow, plan_hash=joiner.plan_hash)
            except Exception as exc:  # it keeps its old plan: the new plan's handshake waits for it, then names it
                log.warning("could not tell %s the run's plan: %s", joiner.name, exc)

    def _broadcast(self, record: Record) -> None:
        for name in self.names:
            try:
                self.transport.send(name, record)
            except Exception:  # best effort while shutting down
                pass

    def _check_children(self) -> None:
        if not self.trained:
            self.greeting.check()  # a stage of another plan: named now, not at the handshake timeout
        for k, p in self.procs.items():
            code = p.poll()
            if code is not None and code != 0:
                cause = exit_cause(code)
                if code > 0 and (line := last_error_line(self.run_dir / "logs" / f"stage{k}.log")):
                    cause += f": {line}"
                # Killed by a signal (SIGKILL, the OOM killer, a crash): its device is lost; an exit code is an
                # error the stage met itself, which a new split would meet again.
                raise StageFailedError(self._failure_line(k, "exited", cause),
                                       lost=LostStage(k, "exited", cause) if code < 0 else None)
        if self.ssh is not None and (ended := self.ssh.ended({s.host for s in self.plan.stages})) is not None:
            host, cause = ended
            hint = f"; {self._resume_hint()}" if self.trained else ""
            # Its stages are gone with it: a loss of that host's devices (runtime.elastic goes on without them).
            gone = [s.index for s in self.plan.stages if s.host == host]
            raise StageFailedError(f"host {host}'s `hetero worker`, started over ssh, ended: {cause}{hint} "
                                   f"(log: {self.ssh.log(host)})",
                                   lost=LostStage(gone[0], "ended with its host's worker", cause, others=tuple(gone[1:])))

    def _gather(self, kind: str, step: int, timeout_s: float) -> dict[int, Any]:
        """One ``kind`` message for ``step`` from every stage, keyed by stage index."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.num_stages:
            try:
                msg = self.mailbox.recv(kind, step=step, timeout_s=max(0.0, deadline - time.monotonic()))
            except WireError as exc:
                if not is_timeout(exc):
                    raise
                missing = sorted(set(range(self.num_stages)) - set(got))
                raise StageFailedError(self._missing(kind, step, timeout_s, missing)) from None
            if msg.sender not in self.names:
                raise WireError(f"'{kind}' from unknown peer {msg.sender!r}")
            got[self.names.index(msg.sender)] = msg
            if kind == "start":
                self.mailbox.bounds.pop(msg.sender, None)  # built: from now on the failure bound applies
        return got

    def _missing(self, kind: str, step: int, timeout_s: float, missing: list[int]) -> str:
        """A one-line explanation of who did not answer, and what to do about it."""
        hosts = sorted({self.plan.stages[k].host for k in missing})
        remote = [h for h in hosts if h != self.host]
        what = f"stage(s) {', '.join(map(str, missing))} on {', '.join(hosts)} sent no '{kind}'"
        what += f" for step {step}" if kind not in ("hello", "start") else ""
        hint = f"see {self.run_dir / 'logs'}"
        if kind == "hello" and remote:
            hint = (f"is `hetero worker plan.json --host {remote[0]} --coordinator {self.endpoint}` running there, "
                    "and can it reach this host?")
            if self.ssh is not None and remote[0] in self.ssh.hosts:
                hint = f"can {remote[0]} reach this host? (its `hetero worker` output: {self.ssh.log(remote[0])})"
        if timeout_s == self.step_timeout_s and kind not in ("hello", "start"):  # a step's wait
            hint = step_timeout_hint(self.plan, timeout_s, hint) + (f"; {self._resume_hint()}" if self.trained else "")
        dropped = next((why for k in missing if (why := self.transport.last_rejection(self.names[k]))), None)
        if dropped:
            hint = f"a message claiming to be from it was dropped: {dropped}"
        elif kind == "hello" and (refused := self.greeting.refused()):
            hint += f"; {refused}"
        return f"{what} within {timeout_s:g} s: {hint}"

    def _handshake(self) -> None:
        """hello from every stage (same plan, same wire version), then welcome with the run settings."""
        timeout = self.options.handshake_timeout_s
        hellos = self._gather("hello", 0, timeout)
        for k, msg in sorted(hellos.items()):
            meta = msg.meta
            if meta.get("input_hash") != self.plan.input_hash or meta.get("stage") != k:
                raise StageFailedError(
                    f"stage {k} runs plan {meta.get('input_hash')} as stage {meta.get('stage')}, this coordinator "
                    f"runs {self.plan.input_hash}: restart every host with the same plan.json"
                )
            if meta.get("wire_version") != WIRE_VERSION:
                raise StageFailedError(f"stage {k} speaks wire v{meta.get('wire_version')}, this coordinator v{WIRE_VERSION}: "
                                       "install the same hetero version on every host")
            self.result.environments[f"stage{k}"] = {"host": self.plan.stages[k].host, "pid": meta.get("pid"),
                                                     **meta.get("env", {})}
            if isinstance(meta.get("pid"), int):
                self.pids.setdefault(k, int(meta["pid"]))
        write_run_file(self.run_dir, "environments.json", json.dumps(self.result.environments, indent=1, default=str))
        now = time.monotonic()
        self.mailbox.last_seen = {name: now for name in self.names}  # from now on, silence means death
        self.mailbox.bounds = {name: self.options.load_timeout_s for name in self.names}  # ... once built
        self.greeting.close()  # its watch on our own dials: the mailbox's watch takes them over
        self.mailbox.watch_connections(self.names)
        resume = None
        if self.options.resume is not None or self.options.checkpoint is not None:  # a checkpoint, or a recovery
            from hetero.runtime.run.checkpoint import load_checkpoint_union

            resume = self.options.checkpoint or load_checkpoint_union(self.options.resume)
            self.memory = resume
            self.start_step = int(resume[1]["step"])
            if self.start_step >= self.plan.train.steps:
                raise StageFailedError(f"{self.options.resume} is after step {self.start_step}, train.steps is "
                                       f"{self.plan.train.steps}: raise it (hetero run ... steps=N) to train on")
        welcome = Welcome(train=to_dict(self.plan.train), failure_timeout_s=self.options.failure_timeout_s,
                          start_step=self.start_step, resume=resume is not None, eval_every=self.plan.eval.every)
        for name in self.names:
            self.transport.send(name, welcome)
        ready = self._gather("start", 0, timeout)
        if self.records.evaluator is not None:  # it built its model meanwhile
            self.records.evaluator.wait_ready(self.options.handshake_timeout_s)
        self.result.build_s = {k: float(m.meta.get("build_s", 0.0)) for k, m in ready.items()}
        self.mover.started(self.result.build_s)
        if resume is not None:
            from hetero.runtime.run.checkpoint import select_payload

            for k, msg in ready.items():
                tensors, meta = select_payload(*resume, list(msg.meta["keys"]), k)
                self.transport.send(self.names[k], "state", tensors=tensors, meta=meta)

    # -- training ---------------------------------------------------------------------------------

    def _send_data(self, batches: Any, step: int) -> tuple[int, int]:
        """Each replica's share of the step's micro-batches: input ids (and packed rows' positions) to its first
        stage, labels to its last, with the whole step's label-token count (every replica's loss is divided by it)."""
        batch = batches.step(step)
        for rep in self.plan.pipelines:
            share = slice(rep.first_micro_batch, rep.first_micro_batch + rep.num_micro_batches)
            inputs = {"input_ids": batch.input_ids[share].contiguous()}
            if batch.position_ids is not None:  # packed rows: where each record starts
                inputs["position_ids"] = batch.position_ids[share].contiguous()
            self.transport.send(self.names[rep.stages[0]], "batch", step=step, tensors=inputs)
            self.transport.send(self.names[rep.stages[-1]], Labels(num_label_tokens=batch.num_label_tokens),
                                step=step, tensors={"labels": batch.labels[share].contiguous()})
        return int(batch.num_label_tokens), int(batch.num_tokens)  # the loss divisor; the tokens that are not padding

    def _end_step(self, step: int, timeout: float) -> tuple[float, float]:
        """The optimizer step's synchronisation: the global gradient norm and clip coefficient to every
        stage; with replicas, each stage's LoRA gradients summed with the other replicas' first."""
        max_norm = self.plan.train.max_grad_norm
        if len(self.plan.pipelines) == 1:
            norms = self._gather("gradnorm", step, timeout)
            grad_norm = norm_from_sumsq({k: float(msg.meta["sumsq"]) for k, msg in norms.items()})
            coef = clip_coef(max_norm, grad_norm)
            self.mover.announce(step, lambda record: [self.transport.send(n, record, step=step) for n in self.names])
            self._announce_snapshot(step)
            for name in self.names:
                self.transport.send(name, Clip(coef=coef, grad_norm=grad_norm), step=step)
            return grad_norm, coef
        grads = self._gather("grads", step, timeout)
        totals = sum_replica_grads(self.plan, {k: msg.tensors for k, msg in grads.items()}, step)
        grad_norm = norm_of(totals)
        coef = clip_coef(max_norm, grad_norm)
        self._announce_snapshot(step)
        for k in sorted(grads):
            self.transport.send(self.names[k], Reduced(coef=coef, grad_norm=grad_norm), step=step,
                                tensors={key: totals[key] for key in grads[k].tensors})
        return grad_norm, coef

    def snapshot_due(self, step: int) -> bool:
        """Whether the stages' state goes to disk after ``step`` because ``runtime.snapshot_every_s`` of training
        passed since it last did (a step that writes a checkpoint anyway, or the last, needs none)."""
        if self.snapshot_every_s <= 0 or checkpoint_due(self.plan.train, step):
            return False
        return time.perf_counter() - self.saved_at >= self.snapshot_every_s

    def memory_due(self, step: int) -> bool:
        """Whether the stages' state is copied to this coordinator's memory after ``step`` (runtime.elastic=auto):
        every ``memory_every`` steps since the newest copy; not after the last step, which writes the adapter."""
        if not self.elastic or step + 1 >= self.plan.train.steps:
            return False
        newest = int(self.memory[1]["step"]) if self.memory is not None else self.start_step
        return step + 1 - newest >= self.memory_every

    def _announce_snapshot(self, step: int) -> None:
        """Before the step's clip: a snapshot after this step (a stage finds it when the clip has come), to disk
        (runtime.snapshot_every_s) or to memory (runtime.elastic)."""
        self.snapshot_to_disk = self.snapshot_due(step)
        self.snapshot_step = step if self.snapshot_to_disk or self.memory_due(step) else None
        if self.snapshot_step is not None and not payload_due(self.plan.train, self.plan.eval.every, step):
            for name in self.names:
                self.transport.send(name, Snapshot(), step=step)

    def _batches(self) -> Any:
        from hetero.runtime.pretrained import resolve_dir
        from hetero.runtime.run.data import StepBatches

        plan, train = self.plan, self.plan.train
        return StepBatches(plan.data, resolve_dir(plan.model), plan.model.seq_len, train.micro_batch_size,
                           train.num_micro_batches, train.seed, train.shuffle)

    def _train(self, batches: Any) -> None:
        """Steps start_step.. : data out, the step's reduction, ``stepdone`` in, the records; Ctrl-C stops
        at the next step boundary with a checkpoint."""
        train, timeout = self.plan.train, self.step_timeout_s
        self.records.start_metrics(self.start_step)
        self.training = self.trained = True
        label_tokens = {self.start_step: self._send_data(batches, self.start_step)}
        last = self.saved_at = time.perf_counter()
        self.snapshot_step: int | None = None
        with ProgressBar(train.steps, self.options.progress) as progress:
            for step in range(self.start_step, train.steps):
                if self.stop_signal is not None:  # Ctrl-C / SIGTERM: `step` steps are done
                    self._checkpoint_and_stop(step)
                    return
                if self.on_return is not None and self.transport.rejected != self.rejected_seen:
                    self.rejected_seen = self.transport.rejected  # something was dropped: a lost device back?
                    if (back := self._returned()) is not None:
                        self._state_after(step)
                        raise back
                self.transport.rules.step = step  # reports for other steps than this and the next are dropped
                # The next step's data travels while this step computes (every stage is in this step: the last
                # one's stepdone came), so no stage waits for its batch or labels at the step boundary.
                if step + 1 < train.steps and self.stop_signal is None:
                    label_tokens[step + 1] = self._send_data(batches, step + 1)
                grad_norm, coef = self._end_step(step, timeout)
                done = self._gather("stepdone", step, timeout)
                now = time.perf_counter()
                labelled, record_tokens = label_tokens.pop(step)
                line = metrics_line(self.plan, step, done, grad_norm, coef, labelled, now - last, record_tokens)
                line["split"] = split_of(self.plan)
                last = now
                self.records.step(line)
                if self.options.recovery is not None and step == self.start_step:
                    self._record_recovery(dict(self.options.recovery))
                progress.update(step, line["loss"], line["tokens_per_s"])
                self.records.record_eval()
                payloads = None
                snapshot, due = self.snapshot_step == step, payload_due(train, self.plan.eval.every, step)
                if due or snapshot:
                    payloads = self._gather("checkpoint", step, timeout)
                    self._keep_in_memory(payloads, time.perf_counter() - now, line["step_time_s"])
                    if due:
                        self.records.save_payloads(step, payloads)
                    if snapshot and self.snapshot_to_disk:
                        self.records.write_checkpoint(step + 1, payloads, snapshot=True)
                    if snapshot or checkpoint_due(train, step):
                        self.saved_at = time.perf_counter()
                    write_run_profile(self.plan, self.run_dir, self.result)  # RUN_DIR/profile.json (issue 22)
                self.mover.observe(step, done)
                if self.mover.due(step):
                    self._move(step, payloads, max(timeout, self.options.handshake_timeout_s))  # stages rebuild

    def _record_recovery(self, event: dict[str, Any]) -> None:
        """The recovery this run continues (runtime/run/elastic.py), after its first step on the new split: a
        metrics.jsonl line with the seconds from the loss to that step."""
        lost_at = event.pop("lost_at", None)
        if isinstance(lost_at, float):
            event["recovery_s"] = round(time.monotonic() - lost_at, 3)
        self.records.event(event)

    def _keep_in_memory(self, payloads: dict[int, Any], copy_s: float, step_s: float) -> None:
        """runtime.elastic=auto: the newest state of every stage, kept here (a lost stage cannot take it along), and
        the steps until the next copy: as many as keep a copy's cost (``copy_s``, the wait for the payloads after
        the step ended; the stages computed the next step meanwhile) under STATE_COPY_SHARE of the steps'
        (planner/state_copy.py)."""
        if not self.elastic:
            return
        from hetero.runtime.run.checkpoint import merge_payloads

        first = self.plan.pipelines[0].stages  # replicas hold the same state
        self.memory = merge_payloads([(payloads[k].tensors, payloads[k].meta) for k in first],
                                     "the stages' payloads disagree on the step")
        if step_s > 0:
            self.memory_every = copy_every(copy_s, step_s)
            log.debug("state copied after step %s in %.4f s (step %.4f s): next copy in %d step(s)",
                      self.memory[1]["step"], copy_s, step_s, self.memory_every)

    def _move(self, step: int, payloads: dict[int, Any] | None, timeout: float) -> None:
        """After step ``step``: the stages rebuilt on their new spans with their new layers' state (moves.py)."""
        self.mailbox.bounds = {name: self.options.load_timeout_s for name in self.names}  # they rebuild
        self.plan, event = self.mover.carry_out(
            step, payloads, lambda kind, s: self._gather(kind, s, timeout),
            lambda k, tensors, meta: self.transport.send(self.names[k], "state", tensors=tensors, meta=meta),
            lambda payloads: self.records.write_checkpoint(step + 1, payloads))
        self.records.event(event)
        log.info("rebalanced after step %d: %s", step, event["cause"]["reason"])

    def _returned(self) -> Rejoining | None:
        """on_return's answer; a failure to plan with a device that came back is said, and the run goes on as it is."""
        try:
            return self.on_return() if self.on_return is not None else None
        except Exception as why:
            print(f"hetero run: runtime.elastic: a device is back, but planning with it failed ({type(why).__name__}: "
                  f"{why}): going on without it", file=sys.stderr, flush=True)
            self.on_return = None  # once: it would fail again at every step
            return None

    def _state_after(self, done: int) -> None:
        """Every stage's state after ``done`` steps into this coordinator's memory (a re-plan goes on from it): as
        after Ctrl-C, no clip went out for the step in progress, so that is the state each stage holds now."""
        if done == 0 or (self.memory is not None and int(self.memory[1]["step"]) == done):
            return
        self.training = False
        for name in self.names:
            self.transport.send(name, Stop(reason="the run re-plans: send your state", checkpoint=done))
        self._keep_in_memory(self._gather("checkpoint", done - 1, self.step_timeout_s), 0.0, 0.0)

    def _checkpoint_and_stop(self, done: int) -> None:
        """After Ctrl-C: every stage's state after ``done`` steps into checkpoints/step-<done>/."""
        from hetero.runtime.base.rundir import COMPLETE, checkpoint_dir

        self.training = False  # from here on, Ctrl-C quits at once
        self.result.interrupted_after = done
        existing = checkpoint_dir(self.run_dir, done)
        if (existing / COMPLETE).is_file():
            self.result.checkpoint = existing  # just written (checkpoint_every), or the one resumed from
            return
        if done == 0:
            return  # nothing trained yet: nothing to keep
        for name in self.names:
            self.transport.send(name, Stop(reason=f"{self.stop_signal}: send a checkpoint", checkpoint=done))
        payloads = self._gather("checkpoint", done - 1, self.step_timeout_s)
        self.result.checkpoint = self.records.write_checkpoint(done, payloads)
