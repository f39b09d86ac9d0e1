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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetero.plan import Plan
from hetero.protocol import (
    Clip,
    Labels,
    Reduced,
    Stop,
)
from hetero.runtime.base.payloads import checkpoint_due, payload_due
from hetero.runtime.base.processes import (
    StageFailedError,
    raise_open_file_limit,
    spawn_stages,
    stop_processes,
)
from hetero.runtime.run.coordinator_failures import FailureHandling
from hetero.runtime.run.coordinator_greeting import Greeting
from hetero.runtime.run.coordinator_state import StateKeeping
from hetero.runtime.run.elastic import Rejoining
from hetero.runtime.run.handshake import HandshakeWatch, connect_stages
from hetero.runtime.run.moves import split_of
from hetero.runtime.run.options import RunOptions, coordinator_endpoint, step_timeout_s
from hetero.runtime.run.records import ProgressBar, RunRecords, RunResult, metrics_line
from hetero.runtime.run.reduce import clip_coef, norm_from_sumsq, norm_of, sum_replica_grads
from hetero.runtime.run.run_profile import write_run_profile
from hetero.runtime.run.stage_eval import StageEval, evaluates_on_stages
from hetero.runtime.wire.control import (
    Heartbeat,
    Mailbox,
    heartbeat_interval,
)
from hetero.security import COORDINATOR

__all__ = ["Coordinator", "RunOptions", "RunResult", "StageFailedError", "coordinator_endpoint"]


log = logging.getLogger("hetero.run")

class Coordinator(FailureHandling, StateKeeping, Greeting):
    """Drives one training run of a plan; see the module docstring."""

    def __init__(self, plan: Plan, plan_path: Path, options: RunOptions) -> None:
        raise_open_file_limit()  # before the inbox listens: a flood of idle connections must not exhaust it
        self.plan, self.plan_path, self.options = plan, plan_path, options
        self.run_dir = options.run_dir
        self.num_stages = len(plan.stages)
        self.host = options.host or plan.stages[0].host
        self.endpoint = coordinator_endpoint(plan, self.host, options.port)
        self._connect()
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

    def _connect(self) -> None:
        """This host's keys and stages, the inbox, the dials to every stage, the mailbox and the run's records."""
        from hetero.runtime.wire.rules import coordinator_rules, max_message_bytes
        from hetero.runtime.wire.transport import Transport
        from hetero.security import install_keys, load_identity

        plan, plan_path, options = self.plan, self.plan_path, self.options
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
        self.stage_eval = StageEval(self.plan, self.names) if evaluates_on_stages(self.plan) else None
        self.records.record_eval([{"error": line} for line in (self.stage_eval.skipped if self.stage_eval else [])])
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

    def _batches(self) -> Any:
        from hetero.runtime.pretrained import resolve_dir
        from hetero.runtime.run.data import StepBatches

        plan, train = self.plan, self.plan.train
        return StepBatches(plan.data, resolve_dir(plan.model), plan.model.seq_len, train.micro_batch_size,
                           train.num_micro_batches, train.seed, train.shuffle, hold_out=plan.eval.split)

    def _train(self, batches: Any) -> None:
        """Steps start_step.. : data out, the step's reduction, ``stepdone`` in, the records; Ctrl-C stops
        at the next step boundary with a checkpoint."""
        train, timeout = self.plan.train, self.step_timeout_s
        self.records.start_metrics(self.start_step, recovering=self.options.recovery is not None)
        self.training = self.trained = True
        label_tokens = {self.start_step: self._send_data(batches, self.start_step)}
        last = self.saved_at = time.perf_counter()
        self.snapshot_step: int | None = None
        with ProgressBar(train.steps, self.options.progress, first=self.start_step) as progress:
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
                line.split = split_of(self.plan)
                last = now
                self.records.step(line)
                if self.options.recovery is not None and step == self.start_step:
                    self._record_recovery(self.options.recovery)
                progress.update(step, line.loss, line.tokens_per_s or 0.0)
                self.records.record_eval()
                if self._evaluated_on_stages(step, timeout):
                    last = time.perf_counter()  # the pass is not part of the next step's time
                payloads = None
                snapshot, due = self.snapshot_step == step, payload_due(train, self.payload_every, step)
                if due or snapshot:
                    payloads = self._gather("checkpoint", step, timeout)
                    self._keep_in_memory(payloads, time.perf_counter() - now, line.step_time_s)
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






