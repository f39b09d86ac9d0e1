"""The coordinator's failures: what a failed run says, and how it stops (or hands over to the next plan).

``Failures`` explains a failure in one line with the stage, host, pid, cause and the command that continues the
run; it stops every stage after a failure or Ctrl-C, or tells them the plan the run goes on under
(runtime.elastic); it watches this host's stage processes and the ssh workers. It owns what a failure leaves: the
stages to kill rather than ask (``hung``), the re-plan runtime.elastic answered (``recovered``), whether the run
was handed over. ``SignalWatch`` owns Ctrl-C / SIGTERM while training. The coordinator (runtime/run/coordinator.py)
holds one of each; both reach the stages through the run's StageLink.
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
from hetero.protocol import Stop
from hetero.runtime.base.processes import (
    LostStage,
    StageFailedError,
    exit_cause,
    is_stopped,
    last_error_line,
    stop_processes,
)
from hetero.runtime.base.rundir import RunDirWriteError, run_command
from hetero.runtime.run.coordinator_greeting import StageLink
from hetero.runtime.run.coordinator_state import StateKeeper
from hetero.runtime.run.elastic import Rejoining
from hetero.runtime.run.options import RunOptions
from hetero.runtime.wire.control import (
    PeerError,
    PeerLost,
    StopRequested,
    drop_unsent,
)

log = logging.getLogger("hetero.run")


class Failures:
    """A failed or interrupted run: the one-line error, stopping the stages, handing over (module docstring)."""

    def __init__(self, link: StageLink, keeper: StateKeeper) -> None:
        self.link, self.keeper = link, keeper
        self.trained = False  # training has begun: a failure's message says how to continue
        self.hung: set[int] = set()  # stages to kill rather than ask to stop
        # runtime.elastic (runtime/run/elastic.py): called with a failure, returns how the run goes on (the next
        # plan, its path, the options) or None; ``recovered`` keeps its answer, for run_elastic.
        self.on_loss: Callable[[StageFailedError], tuple[Plan, Path, RunOptions] | None] | None = None
        self.recovered: tuple[Plan, Path, RunOptions] | None = None
        self.handed_over = False  # the run goes on under another plan: the ssh workers stay (they follow it)
        link.resume_hint = lambda: self.resume_hint() if self.trained else None

    def abort(self, exc: BaseException, heartbeat: Any) -> HeteroError | None:
        """Stop every stage after ``exc``; returns the one-line error to raise instead (None: ``exc`` itself)."""
        link = self.link
        if isinstance(exc, KeyboardInterrupt):
            heartbeat.stopped.set()
        else:  # heartbeats go on while the state is written and a re-plan is made: the stages left must not time out
            self.keeper.save_memory()  # before the error line: its resume command names the newest checkpoint
        error = self.explain(exc)
        reason = "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else f"run failed: {error or exc}"
        failed = error if error is not None else exc
        if self.on_loss is not None and isinstance(failed, StageFailedError):
            try:
                self.recovered = self.on_loss(failed)
            except Exception as why:  # a re-plan that fails ends the run with the loss's own line
                log.warning("runtime.elastic: could not re-plan: %s: %s", type(why).__name__, why)
                print(f"hetero run: runtime.elastic: could not re-plan ({type(why).__name__}: {why}): stopping",
                      file=sys.stderr, flush=True)
        heartbeat.stopped.set()  # nothing may queue behind the stop for stages about to exit
        if isinstance(exc, Rejoining):
            self.hand_over(exc.plan, exc.path, None, exc.joiners)
        elif self.recovered is not None:
            lost = failed.lost.stage if isinstance(failed, StageFailedError) and failed.lost is not None else None
            self.hand_over(self.recovered[0], self.recovered[1], lost)
        else:
            link.broadcast(Stop(reason=reason))
        stop_processes(link.procs, grace_s=3.0, kill_now=self.hung)
        # Dead stages never take what is queued for them: give live remote ones a second, not 10,
        # and the local ones (all gone now) nothing.
        drop_unsent(link.transport, linger_ms=1000)
        drop_unsent(link.transport, 0, [link.names[k] for k in link.procs])
        return error

    def explain(self, exc: BaseException) -> HeteroError | None:
        """The one-line error for a failed run; None: re-raise ``exc`` as it is."""
        link = self.link
        if isinstance(exc, RunDirWriteError):
            return exc.for_run(link.options.rerun)  # its resume command repeats this run's --host/--port
        if not isinstance(exc, (PeerError, PeerLost, StopRequested)):
            return None  # StageFailedError and the like are explained already; Ctrl-C and bugs pass
        try:
            self.check_children()  # a local stage that exited is the most precise cause
        except StageFailedError as dead:
            return dead
        k = link.names.index(exc.peer) if isinstance(exc, (PeerError, PeerLost)) and exc.peer in link.names else None
        if k is None:
            return StageFailedError(f"{exc} (logs: {link.run_dir / 'logs'})")
        if isinstance(exc, PeerError):
            return StageFailedError(self.failure_line(k, "failed", exc.message))
        cause = exc.cause
        if exc.silent:
            self.hung.add(k)
            if k in link.procs and is_stopped(link.procs[k].pid):
                cause = cause.replace("(hung or stopped?)", "(the process is stopped: SIGSTOP or Ctrl-Z?)")
        return StageFailedError(self.failure_line(k, "stopped responding", cause),
                                lost=LostStage(k, "stopped responding", cause))

    def failure_line(self, k: int, what: str, cause: str) -> str:
        """``stage 1 exited on host h (pid 42): killed by SIGKILL; continue after step 4 with `...` (log: ...)``."""
        link = self.link
        host = link.plan.stages[k].host
        pid = f" (pid {link.pids[k]})" if k in link.pids else ""
        log = str(link.run_dir / "logs" / f"stage{k}.log") if k in link.procs else f"on {host}, under `hetero worker`"
        if link.ssh is not None and host in link.ssh.hosts:
            log = f"on {host}, {link.ssh.remote_run_dir(host)}/logs/stage{k}.log"
        hint = f"; {self.resume_hint()}" if self.trained else ""
        return f"stage {k} {what} on host {host}{pid}: {cause}{hint} (log: {log})"

    def command(self) -> str:
        """The `hetero run` command line that runs this plan again, in this run directory's copy."""
        return shlex.join(run_command(self.link.plan_path, self.link.options.rerun))

    def resume_hint(self) -> str:
        from hetero.runtime.base.rundir import checkpoint_step, latest_checkpoint

        # The state copied off the stages goes to disk first, so that the line names it (it said "no checkpoint
        # yet" when the run stopped without recovering, though the copy was written a moment later).
        self.keeper.save_memory()
        run_dir, options = self.link.run_dir, self.link.options
        last = latest_checkpoint(run_dir)
        if last is not None:
            return (f"continue after step {checkpoint_step(last)} with "
                    f"`{self.command()} --resume {shlex.quote(str(run_dir))}`")
        if options.resume is not None:
            return (f"no newer checkpoint: continue with `{self.command()} --resume "
                    f"{shlex.quote(str(options.resume))} --run-dir {shlex.quote(str(run_dir))}`")
        return (f"no checkpoint yet (one is written after every runtime.snapshot_every_s={options.snapshot_every_s:g} "
                f"s of training, and every train.checkpoint_every steps): start again with "
                f"`{self.command()} --run-dir {shlex.quote(str(run_dir))}`")

    def check_children(self) -> None:
        """A local stage that exited, or an ssh worker that ended, is a StageFailedError naming it."""
        link = self.link
        if not self.trained:
            link.greeting.check()  # a stage of another plan: named now, not at the handshake timeout
        for k, p in link.procs.items():
            code = p.poll()
            if code is not None and code != 0:
                cause = exit_cause(code)
                if code > 0 and (line := last_error_line(link.run_dir / "logs" / f"stage{k}.log")):
                    cause += f": {line}"
                # Killed by a signal (SIGKILL, the OOM killer, a crash): its device is lost; an exit code is an
                # error the stage met itself, which a new split would meet again.
                raise StageFailedError(self.failure_line(k, "exited", cause),
                                       lost=LostStage(k, "exited", cause) if code < 0 else None)
        if link.ssh is not None and (ended := link.ssh.ended({s.host for s in link.plan.stages})) is not None:
            host, cause = ended
            hint = f"; {self.resume_hint()}" if self.trained else ""
            # Its stages are gone with it: a loss of that host's devices (runtime.elastic goes on without them).
            gone = [s.index for s in link.plan.stages if s.host == host]
            raise StageFailedError(f"host {host}'s `hetero worker`, started over ssh, ended: {cause}{hint} "
                                   f"(log: {link.ssh.log(host)})",
                                   lost=LostStage(gone[0], "ended with its host's worker", cause, others=tuple(gone[1:])))

    def hand_over(self, plan: Plan, path: Path, lost: int | None, joiners: Sequence[Any] = ()) -> None:
        """Stop every stage; the remote ones that are left, and the stages of devices that came back (``joiners``,
        elastic.Joiner: told under the plan they run), learn the plan the run goes on under: their `hetero worker`
        starts its stages of it (runtime/run/host.py). This host's stages are restarted by run_elastic."""
        link = self.link
        self.handed_over = True
        number = int(path.stem.rsplit("-", 1)[-1])
        text = path.read_text()
        follow = Stop(reason=f"the run goes on under {path.name}", plan=text, replan=number)
        for k, name in enumerate(link.names):
            remote = link.plan.stages[k].host != link.host and k != lost
            try:
                link.transport.send(name, follow if remote else Stop(reason=f"the run goes on under {path.name}"))
            except Exception:  # best effort: a stage that misses it ends on the coordinator's silence
                pass
        for joiner in joiners:
            try:
                link.transport.connect(joiner.name, joiner.endpoint)
                link.transport.send(joiner.name, follow, plan_hash=joiner.plan_hash)
            except Exception as exc:  # it keeps its old plan: the new plan's handshake waits for it, then names it
                log.warning("could not tell %s the run's plan: %s", joiner.name, exc)


class SignalWatch:
    """SIGINT/SIGTERM while ``training``: ``stop_signal`` names the first, and the run checkpoints at the next step
    boundary; before training, or the second time, they stop the run at once."""

    def __init__(self) -> None:
        self.training = False  # between the first data sent and the last step: Ctrl-C means "checkpoint, then stop"
        self.stop_signal: str | None = None  # the first SIGINT/SIGTERM received while training

    def catch(self) -> Callable[[], None]:
        """Handlers installed (in the main thread only); returns the undo."""
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
