"""The coordinator's failures: what a failed run says, and how it stops (or hands over to the next plan).

``FailureHandling`` is a part of ``Coordinator`` (runtime/run/coordinator.py): it explains a failure in one line
with the stage, host, pid, cause and the command that continues the run; it stops every stage after a failure or
Ctrl-C, or tells them the plan the run goes on under (runtime.elastic); it watches this host's stage processes
and the ssh workers. It reads the coordinator's plan, options, run directory, processes, transport and records.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError
from hetero.plan import Plan
from hetero.protocol import (
    Record,
    Stop,
)
from hetero.runtime.base.processes import (
    LostStage,
    StageFailedError,
    exit_cause,
    is_stopped,
    last_error_line,
    stop_processes,
)
from hetero.runtime.base.rundir import RunDirWriteError, run_command
from hetero.runtime.run.elastic import Rejoining
from hetero.runtime.wire.control import (
    PeerError,
    PeerLost,
    StopRequested,
    drop_unsent,
)

log = logging.getLogger("hetero.run")


class FailureHandling:
    """A failed or interrupted run: the one-line error, stopping the stages, handing over (module docstring)."""

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
        """``stage 1 exited on host h (pid 42): killed by SIGKILL; continue after step 4 with `...` (log: ...)``."""
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
            return (f"continue after step {checkpoint_step(last)} with "
                    f"`{self._command()} --resume {shlex.quote(str(self.run_dir))}`")
        if self.options.resume is not None:
            return (f"no newer checkpoint: continue with `{self._command()} --resume "
                    f"{shlex.quote(str(self.options.resume))} --run-dir {shlex.quote(str(self.run_dir))}`")
        return (f"no checkpoint yet (one is written after every runtime.snapshot_every_s={self.snapshot_every_s:g} s of "
                f"training, and every train.checkpoint_every steps): start again with "
                f"`{self._command()} --run-dir {shlex.quote(str(self.run_dir))}`")

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

    def _catch_signals(self) -> Callable[[], None]:
        """SIGINT/SIGTERM while training: checkpoint at the next step boundary; returns the undo."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        unraisable = sys.unraisablehook

        def redeliver(info: Any) -> None:
            # A second Ctrl-C's KeyboardInterrupt that landed in a C-level finalizer (a ZeroMQ frame freed) is
            # swallowed there, "Exception ignored" and a traceback: deliver it again, at the next safe point.
            if isinstance(info.exc_value, KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
            else:
                unraisable(info)

        sys.unraisablehook = redeliver

        def restore() -> None:
            sys.unraisablehook = unraisable
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

        return restore

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.training or self.stop_signal is not None:
            raise KeyboardInterrupt  # before training, or the second time: stop at once
        self.stop_signal = signal.Signals(signum).name
        print(f"hetero run: {self.stop_signal}: stopping after this step with a checkpoint "
              "(Ctrl-C again to quit at once, from the newest complete one)", file=sys.stderr, flush=True)

    def _broadcast(self, record: Record) -> None:
        for name in self.names:
            try:
                self.transport.send(name, record)
            except Exception:  # best effort while shutting down
                pass
