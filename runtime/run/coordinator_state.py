"""The coordinator's copies of the stages' state: snapshots to disk, copies to memory, Ctrl-C's checkpoint.

``StateKeeping`` is a part of ``Coordinator`` (runtime/run/coordinator.py): when the stages send their state
after a step (runtime.snapshot_every_s, runtime.elastic's copies, checkpoint_every, Ctrl-C), what the coordinator
keeps of it, and the run's moves between splits (rebalancing, a device that returns).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from typing import Any

from hetero.planner.model.state_copy import copy_every
from hetero.protocol import (
    Snapshot,
    Stop,
)
from hetero.runtime.base.payloads import checkpoint_due, payload_due
from hetero.runtime.run.elastic import Rejoining
from hetero.runtime.run.metrics_file import RecoveryEvent

log = logging.getLogger("hetero.run")


class StateKeeping:
    """When the stages' state is copied off them, and what the coordinator keeps (module docstring)."""

    @property
    def payload_every(self) -> int:
        """The eval.every by which the stages send their state: a spare evaluator's adapters (the training stages
        evaluate without them)."""
        return self.plan.eval.every if self.stage_eval is None else 0

    def _evaluated_on_stages(self, step: int, timeout_s: float) -> bool:
        """The training stages' evaluation after ``step`` when due (runtime/run/stage_eval.py), recorded."""
        if self.stage_eval is None or not self.stage_eval.due(step):
            return False
        self.records.record_eval([self.stage_eval.run(self.transport, self.mailbox, step, timeout_s)])
        return True

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
        if self.snapshot_step is not None and not payload_due(self.plan.train, self.payload_every, step):
            for name in self.names:
                self.transport.send(name, Snapshot(), step=step)

    def _keep_in_memory(self, payloads: dict[int, Any], copy_s: float, step_s: float) -> None:
        """runtime.elastic=auto: the newest state of every stage, kept here (a lost stage cannot take it along), and
        the steps until the next copy: as many as keep a copy's cost (``copy_s``, the wait for the payloads after
        the step ended; the stages computed the next step meanwhile) under STATE_COPY_SHARE of the steps'
        (planner/model/state_copy.py)."""
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

    def _record_recovery(self, event: RecoveryEvent) -> None:
        """The recovery this run continues (runtime/run/elastic.py), after its first step on the new split: a
        metrics.jsonl line with the seconds from the loss to that step."""
        if event.lost_at is not None:
            event = replace(event, recovery_s=round(time.monotonic() - event.lost_at, 3), lost_at=None)
        self.records.event(event)

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
        self.mailbox.bounds = {name: self.options.load_timeout_s for name in self.names}  # they rebuild
        self.plan, event = self.mover.carry_out(
            step, payloads, lambda kind, s: self._gather(kind, s, timeout),
            lambda k, tensors, meta: self.transport.send(self.names[k], "state", tensors=tensors, meta=meta),
            lambda payloads: self.records.write_checkpoint(step + 1, payloads))
        self.records.event(event)
        log.info("rebalanced after step %d: %s", step, event.cause.reason)
