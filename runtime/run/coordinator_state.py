"""The coordinator's copies of the stages' state: snapshots to disk, copies to memory, Ctrl-C's checkpoint.

``StateKeeper`` owns when the stages send their state after a step (runtime.snapshot_every_s, runtime.elastic's
copies; checkpoint_every and the evaluator's adapters come with payload_due) and what the coordinator keeps of it:
``memory``, the union of the newest payloads, which a re-plan goes on from and a failure writes to disk. The
coordinator (runtime/run/coordinator.py) holds one; it talks to the stages through the run's StageLink.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hetero.planner.model.state_copy import copy_every
from hetero.protocol import Snapshot, Stop
from hetero.runtime.base.payloads import checkpoint_due, payload_due
from hetero.runtime.run.coordinator_greeting import StageLink

log = logging.getLogger("hetero.run")

State = tuple[dict[str, Any], dict[str, Any]]  # (tensors, meta): every stage's payload merged


class StateKeeper:
    """When the stages' state is copied off them, and what the coordinator keeps (module docstring).
    ``payload_every``: the eval.every by which the stages send their state anyway (a spare evaluator's adapters)."""

    def __init__(self, link: StageLink, records: Any, payload_every: int) -> None:
        self.link, self.records, self.payload_every = link, records, payload_every
        options = link.options
        self.snapshot_every_s = options.snapshot_every_s  # 0: no time-based checkpoints
        self.saved_at = time.perf_counter()  # when the stages' state last went to disk (or training began)
        # runtime.elastic=auto: the stages' state, copied off them every ``memory_every`` steps (runtime/run/elastic.py)
        self.elastic = options.elastic == "auto"
        self.memory: State | None = None  # the union of the newest payloads
        # Steps between copies: the first comes after one step (it protects the run early and is measured), the next
        # ones as far apart as what a copy measured against a step requires (the plan's prediction is shown only).
        self.memory_every = 1
        self.start_step = 0
        self.snapshot_to_disk = False
        self.snapshot_step: int | None = None  # the step after which the stages send a snapshot

    @property
    def newest(self) -> int:
        """The steps done in the newest copy in memory (the start step without one)."""
        return int(self.memory[1]["step"]) if self.memory is not None else self.start_step

    def snapshot_due(self, step: int) -> bool:
        """Whether the stages' state goes to disk after ``step`` because ``runtime.snapshot_every_s`` of training
        passed since it last did (a step that writes a checkpoint anyway, or the last, needs none)."""
        if self.snapshot_every_s <= 0 or checkpoint_due(self.link.plan.train, step):
            return False
        return time.perf_counter() - self.saved_at >= self.snapshot_every_s

    def memory_due(self, step: int) -> bool:
        """Whether the stages' state is copied to this coordinator's memory after ``step`` (runtime.elastic=auto):
        every ``memory_every`` steps since the newest copy; not after the last step, which writes the adapter."""
        if not self.elastic or step + 1 >= self.link.plan.train.steps:
            return False
        return step + 1 - self.newest >= self.memory_every

    def announce(self, step: int) -> None:
        """Before the step's clip: a snapshot after this step (a stage finds it when the clip has come), to disk
        (runtime.snapshot_every_s) or to memory (runtime.elastic)."""
        self.snapshot_to_disk = self.snapshot_due(step)
        self.snapshot_step = step if self.snapshot_to_disk or self.memory_due(step) else None
        if self.snapshot_step is not None and not payload_due(self.link.plan.train, self.payload_every, step):
            self.link.send_all(Snapshot(), step=step)

    def after_step(self, step: int, timeout_s: float, ended_at: float, step_s: float) -> dict[int, Any] | None:
        """The stages' payloads after ``step`` when any are due (None otherwise): to the evaluator, a checkpoint,
        the adapter (records.save_payloads), a snapshot to disk, a copy in memory."""
        snapshot, due = self.snapshot_step == step, payload_due(self.link.plan.train, self.payload_every, step)
        if not (due or snapshot):
            return None
        payloads = self.link.gather("checkpoint", step, timeout_s)
        self.keep(payloads, time.perf_counter() - ended_at, step_s)
        if due:
            self.records.save_payloads(step, payloads)
        if snapshot and self.snapshot_to_disk:
            self.records.write_checkpoint(step + 1, payloads, snapshot=True)
        if snapshot or checkpoint_due(self.link.plan.train, step):
            self.saved_at = time.perf_counter()
        return payloads

    def keep(self, payloads: dict[int, Any], copy_s: float, step_s: float) -> None:
        """runtime.elastic=auto: the newest state of every stage, kept here (a lost stage cannot take it along), and
        the steps until the next copy: as many as keep a copy's cost (``copy_s``, the wait for the payloads after
        the step ended; the stages computed the next step meanwhile) under STATE_COPY_SHARE of the steps'
        (planner/model/state_copy.py)."""
        if not self.elastic:
            return
        from hetero.runtime.run.checkpoint import merge_payloads

        first = self.link.plan.pipelines[0].stages  # replicas hold the same state
        self.memory = merge_payloads([(payloads[k].tensors, payloads[k].meta) for k in first],
                                     "the stages' payloads disagree on the step")
        if step_s > 0:
            self.memory_every = copy_every(copy_s, step_s)
            log.debug("state copied after step %s in %.4f s (step %.4f s): next copy in %d step(s)",
                      self.memory[1]["step"], copy_s, step_s, self.memory_every)

    def state_after(self, done: int) -> None:
        """Every stage's state after ``done`` steps into this coordinator's memory (a re-plan goes on from it): as
        after Ctrl-C, no clip went out for the step in progress, so that is the state each stage holds now."""
        if done == 0 or (self.memory is not None and int(self.memory[1]["step"]) == done):
            return
        self.link.send_all(Stop(reason="the run re-plans: send your state", checkpoint=done))
        self.keep(self.link.gather("checkpoint", done - 1, self.link.step_timeout_s), 0.0, 0.0)

    def checkpoint(self, done: int, why: str) -> Path | None:
        """After Ctrl-C (``why``: the signal): every stage's state after ``done`` steps in checkpoints/step-<done>/
        (None: nothing trained yet)."""
        from hetero.runtime.base.rundir import COMPLETE, checkpoint_dir

        existing = checkpoint_dir(self.link.run_dir, done)
        if (existing / COMPLETE).is_file():
            return existing  # just written (checkpoint_every), or the one resumed from
        if done == 0:
            return None  # nothing trained yet: nothing to keep
        self.link.send_all(Stop(reason=f"{why}: send a checkpoint", checkpoint=done))
        return self.records.write_checkpoint(done, self.link.gather("checkpoint", done - 1, self.link.step_timeout_s))

    def save_memory(self) -> None:
        """The state copied off the stages (runtime.elastic), to disk as a snapshot when no checkpoint there is as
        new: before a failure's line, so that its resume command names it."""
        from hetero.errors import HeteroError
        from hetero.runtime.base.rundir import checkpoint_step, latest_checkpoint

        if self.memory is None or int(self.memory[1]["step"]) <= 0:
            return
        newest = latest_checkpoint(self.link.run_dir)
        if newest is not None and checkpoint_step(newest) >= int(self.memory[1]["step"]):
            return
        try:
            self.records.write_state(self.memory)
        except HeteroError as exc:  # a full disk: the failure's own line says what to do
            log.warning("could not keep the run's state on disk: %s", exc)
