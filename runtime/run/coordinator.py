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

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetero.plan import Plan
from hetero.protocol import Clip, GradNorm, Labels, Reduced, Stop
from hetero.runtime.base.processes import StageFailedError, raise_open_file_limit, stop_processes
from hetero.runtime.run.coordinator_failures import Failures, SignalWatch
from hetero.runtime.run.coordinator_greeting import StageLink, handshake
from hetero.runtime.run.coordinator_state import StateKeeper
from hetero.runtime.run.elastic import Rejoining, completed
from hetero.runtime.run.metrics_file import StepLine
from hetero.runtime.run.moves import Mover, split_of
from hetero.runtime.run.options import RunOptions, coordinator_endpoint
from hetero.runtime.run.records import ProgressBar, RunRecords, RunResult, metrics_line
from hetero.runtime.run.reduce import clip_coef, norm_from_sumsq, norm_of, sum_replica_grads
from hetero.runtime.run.replan_moves import replanning
from hetero.runtime.run.run_profile import write_run_profile
from hetero.runtime.run.stage_eval import StageEval, evaluates_on_stages
from hetero.runtime.wire.control import Heartbeat, heartbeat_interval
from hetero.runtime.wire.frames import record_of

__all__ = ["Coordinator", "RunOptions", "RunResult", "StageFailedError", "coordinator_endpoint"]


log = logging.getLogger("hetero.run")

class Coordinator:
    """Drives one training run of a plan; see the module docstring. Its collaborators own their state: ``link`` the
    stages' processes, sockets and handshake (coordinator_greeting.py), ``keeper`` the copies of the stages' state
    (coordinator_state.py), ``failures`` what a failure says and stops (coordinator_failures.py), ``signals``
    Ctrl-C, ``records`` the run directory's files (records.py), ``mover`` the rebalancing moves (moves.py)."""

    failures: Failures  # (declared: the link's idle check, made before it, calls it)

    def __init__(self, plan: Plan, plan_path: Path, options: RunOptions) -> None:
        self.began = time.perf_counter()  # a re-plan move costs about this coordinator's start (it restarts stages)
        raise_open_file_limit()  # before the inbox listens: a flood of idle connections must not exhaust it
        self.options, self.run_dir = options, options.run_dir
        self.host = options.host or plan.stages[0].host
        self.endpoint = coordinator_endpoint(plan, self.host, options.port)
        self.link = StageLink(plan, plan_path, options, self.host, self.endpoint,
                              on_idle=lambda: self.failures.check_children())
        try:  # metrics, evaluations, checkpoints, adapter, TensorBoard (and W&B)
            self.records = RunRecords(plan, self.run_dir, wandb=options.wandb)
        except BaseException:
            self.link.abandon()
            raise
        self.result = self.records.result
        self.stage_eval: StageEval | None = None  # the training stages evaluate (made in run: it may refuse)
        # The eval.every by which the stages send their state: a spare evaluator's adapters (the training stages
        # evaluate without them).
        self.keeper = StateKeeper(self.link, self.records, 0 if evaluates_on_stages(plan) else plan.eval.every)
        self.failures = Failures(self.link, self.keeper)
        self.signals = SignalWatch()
        self.heartbeat = Heartbeat(self.link.transport, self.link.names,
                                   interval_s=heartbeat_interval(options.failure_timeout_s))
        self.mover = Mover(plan, options.rebalance, options.moves, options.replans, options.replans_made)
        self.start_step = 0  # > 0 when resuming from a checkpoint
        # ... and at a step boundary, whether a device that was lost is back (a Rejoining to go on with it, or None)
        self.on_return: Callable[[], Rejoining | None] | None = None
        self.rejected_seen = 0  # the transport's drop count when on_return last looked

    @property
    def plan(self) -> Plan:
        return self.link.plan

    # -- lifecycle --------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Train for plan.train.steps steps; raises HeteroError (one line) when anything fails."""
        restore_signals: Callable[[], None] = lambda: None  # noqa: E731
        try:
            self._start_processes()
            self.heartbeat.start()
            restore_signals = self.signals.catch()
            self._run()
        except BaseException as exc:
            error = self.failures.abort(exc, self.heartbeat)
            if error is not None:
                raise error from None
            raise
        finally:
            self._close(restore_signals)
        return self.result

    def _start_processes(self) -> None:
        """The evaluator, and which remote hosts to wait for (or start over ssh); this host's stages run already."""
        link, options = self.link, self.options
        remote = sorted({s.host for s in self.plan.stages if s.host != self.host})
        self.records.open_evaluator(link.plan_path, self.host)
        self.stage_eval = StageEval(self.plan, link.names) if evaluates_on_stages(self.plan) else None
        self.records.record_eval([{"error": line} for line in (self.stage_eval.skipped if self.stage_eval else [])])
        if options.ssh_workers is not None:  # a re-planned run: the workers follow its plan (host.py)
            link.ssh = options.ssh_workers
            remote = [h for h in remote if h not in link.ssh.hosts]
        elif options.ssh_hosts:
            from hetero.runtime.run.ssh import SshWorkers

            link.ssh = SshWorkers(options.ssh_hosts, self.run_dir)
            remote = [h for h in remote if h not in link.ssh.hosts]
        if remote and options.recovery is not None:
            print(f"hetero run: waiting for hosts {', '.join(remote)}: their `hetero worker` starts its stages of "
                  f"{link.plan_path.name}", flush=True)
        elif remote:
            commands = "; ".join(f"on {h}: `hetero worker plan.json --host {h} --coordinator {self.endpoint}`"
                                 for h in remote)
            print(f"hetero run: waiting for hosts {', '.join(remote)}: start each with its copy of this plan.json, "
                  f"{commands}", flush=True)

    def _run(self) -> None:
        """Remote hosts started, handshake, training, last evaluation, and the final stop."""
        if self.link.ssh is not None and self.options.ssh_workers is None:
            self.link.ssh.start(self.endpoint)
            print(f"hetero run: started hosts {', '.join(self.link.ssh.hosts)} over ssh (their output: "
                  f"{self.run_dir / 'logs'}/host-NAME.log)", flush=True)
        # Tokenize while the stages import and build (before anyone watches for silence).
        batches = self.options.batches if self.options.batches is not None else self._batches()
        self._handshake()
        self._train(batches)
        self.records.finish_eval()
        self.heartbeat.stopped.set()  # nothing may queue behind the stop for stages about to exit
        interrupted = self.result.interrupted_after is not None
        self.link.broadcast(Stop(reason=f"{self.signals.stop_signal}: checkpoint saved" if interrupted
                                 else "training finished"))
        stop_processes(self.link.procs)
        if self.link.ssh is not None:
            self.link.ssh.wait(5.0)  # told to stop, the remote workers end on their own

    def _handshake(self) -> None:
        """Every stage's hello and start (coordinator_greeting.handshake): where the run starts, the builds' times."""
        on_stages = self.stage_eval.welcome() if self.stage_eval is not None else {}  # else the spare device's
        started = handshake(self.link, self.records, {"eval_every": self.keeper.payload_every, **on_stages})
        self.start_step = self.keeper.start_step = started.start_step
        self.keeper.memory = started.resume
        self.result.build_s = started.build_s
        self.mover.started(started.build_s, time.perf_counter() - self.began)

    def _close(self, restore_signals: Callable[[], None]) -> None:
        """Whatever happened: the evaluator, the ssh workers, signal handlers, heartbeats, sockets."""
        self.records.close()
        if self.link.ssh is not None and not self.failures.handed_over:
            self.link.ssh.stop()  # after the stop broadcast: each remote worker ends, or is ended
        restore_signals()
        self.heartbeat.finish()
        self.link.close()

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
            self.link.transport.send(self.link.names[rep.stages[0]], "batch", step=step, tensors=inputs)
            self.link.transport.send(self.link.names[rep.stages[-1]], Labels(num_label_tokens=batch.num_label_tokens),
                                step=step, tensors={"labels": batch.labels[share].contiguous()})
        return int(batch.num_label_tokens), int(batch.num_tokens)  # the loss divisor; the tokens that are not padding

    def _end_step(self, step: int, timeout: float) -> tuple[float, float]:
        """The optimizer step's synchronisation: the global gradient norm and clip coefficient to every
        stage; with replicas, each stage's LoRA gradients summed with the other replicas' first."""
        max_norm = self.plan.train.max_grad_norm
        if len(self.plan.pipelines) == 1:
            norms = self.link.gather("gradnorm", step, timeout)
            grad_norm = norm_from_sumsq({k: float(record_of(msg, GradNorm).sumsq) for k, msg in norms.items()})
            coef = clip_coef(max_norm, grad_norm)
            self.mover.announce(step, lambda record: [self.link.transport.send(n, record, step=step) for n in self.link.names])
            self.keeper.announce(step)
            self.link.send_all(Clip(coef=coef, grad_norm=grad_norm), step=step)
            return grad_norm, coef
        grads = self.link.gather("grads", step, timeout)
        totals = sum_replica_grads(self.plan, {k: msg.tensors for k, msg in grads.items()}, step)
        grad_norm = norm_of(totals)
        coef = clip_coef(max_norm, grad_norm)
        self.keeper.announce(step)
        for k in sorted(grads):
            self.link.transport.send(self.link.names[k], Reduced(coef=coef, grad_norm=grad_norm), step=step,
                                tensors={key: totals[key] for key in grads[k].tensors})
        return grad_norm, coef

    def _batches(self) -> Any:
        from hetero.runtime.pretrained import resolve_dir
        from hetero.runtime.run.data import StepBatches

        plan, train = self.plan, self.plan.train
        return StepBatches(plan.data, resolve_dir(plan.model), plan.model.seq_len, train.micro_batch_size,
                           train.num_micro_batches, train.seed, train.shuffle, hold_out=plan.eval.split)

    def _train(self, batches: Any) -> None:
        """Steps start_step.. : data out, the step's reduction, ``stepdone`` in, the records; Ctrl-C stops
        at the next step boundary with a checkpoint; a device back (runtime.elastic) turns the run at one."""
        train, link, signals = self.plan.train, self.link, self.signals
        self.records.start_metrics(self.start_step, recovering=self.options.recovery is not None)
        signals.training = self.failures.trained = True
        label_tokens = {self.start_step: self._send_data(batches, self.start_step)}
        self.last = self.keeper.saved_at = time.perf_counter()
        with ProgressBar(train.steps, self.options.progress, first=self.start_step) as progress:
            for step in range(self.start_step, train.steps):
                if signals.stop_signal is not None:  # Ctrl-C / SIGTERM: `step` steps are done
                    signals.training = False  # from here on, Ctrl-C quits at once
                    self.result.interrupted_after = step
                    self.result.checkpoint = self.keeper.checkpoint(step, signals.stop_signal)
                    return
                if (replan := self.mover.replan_due(step)) is not None and (turn := replanning(self, replan)):
                    raise turn  # rebalanced by a re-plan (replan_moves.py): the stages go on under it
                if self.on_return is not None and link.transport.rejected != self.rejected_seen:
                    self.rejected_seen = link.transport.rejected  # something was dropped: a lost device back?
                    if (back := self._returned()) is not None:
                        signals.training = False
                        self.keeper.state_after(step)
                        raise back
                link.transport.rules.step = step  # reports for other steps than this and the next are dropped
                # The next step's data travels while this step computes (every stage is in this step: the last
                # one's stepdone came), so no stage waits for its batch or labels at the step boundary.
                if step + 1 < train.steps and signals.stop_signal is None:
                    label_tokens[step + 1] = self._send_data(batches, step + 1)
                line = self._step(step, *label_tokens.pop(step))
                progress.update(step, line.loss, line.tokens_per_s or 0.0)

    def _step(self, step: int, labelled: int, record_tokens: int) -> StepLine:
        """One step from its clip on: the reduction, the stages' ``stepdone``, the metrics line, the evaluations,
        the state the stages send after it, and a rebalancing move when one is due."""
        timeout = self.link.step_timeout_s
        grad_norm, coef = self._end_step(step, timeout)
        done = self.link.gather("stepdone", step, timeout)
        now = time.perf_counter()
        line = metrics_line(self.plan, step, done, grad_norm, coef, labelled, now - self.last, record_tokens)
        line.split = split_of(self.plan)
        self.last = now
        self.records.step(line)
        if self.options.recovery is not None and step == self.start_step:
            self.records.event(completed(self.options.recovery))  # the recovery (or re-plan) this run goes on from
        self.records.record_eval()
        if self.stage_eval is not None and self.stage_eval.due(step):  # the training stages evaluate
            self.records.record_eval([self.stage_eval.run(self.link.transport, self.link.mailbox, step, timeout)])
            self.last = time.perf_counter()  # the pass is not part of the next step's time
        payloads = self.keeper.after_step(step, timeout, now, line.step_time_s)
        if payloads is not None:
            write_run_profile(self.plan, self.run_dir, self.result)  # RUN_DIR/profile.json (issue 22)
        self.mover.observe(step, done)
        if self.mover.due(step):
            self._move(step, payloads, max(timeout, self.options.handshake_timeout_s))  # stages rebuild
        return line

    def _returned(self) -> Rejoining | None:
        """on_return's answer; a failure to plan with a device that came back is said, and the run goes on as it is."""
        try:
            return self.on_return() if self.on_return is not None else None
        except Exception as why:
            print(f"hetero run: runtime.elastic: a device is back, but planning with it failed ({type(why).__name__}: "
                  f"{why}): going on without it", file=sys.stderr, flush=True)
            self.on_return = None  # once: it would fail again at every step
            return None

    def _move(self, step: int, payloads: dict[int, Any] | None, timeout: float) -> None:
        """After step ``step``: the stages rebuilt on their new spans with their new layers' state (moves.py)."""
        link = self.link
        link.mailbox.bounds = {name: self.options.load_timeout_s for name in link.names}  # they rebuild
        link.plan, event = self.mover.carry_out(
            step, payloads, lambda kind, s: link.gather(kind, s, timeout),
            lambda k, tensors, meta: link.transport.send(link.names[k], "state", tensors=tensors, meta=meta),
            lambda payloads: self.records.write_checkpoint(step + 1, payloads))
        self.records.event(event)
        log.info("rebalanced after step %d: %s", step, event.cause.reason)
