"""Recovery without a person (`hetero run ... runtime.elastic=auto`, the default).

While it trains, the coordinator copies every stage's state (LoRA weights, AdamW moments, step count: the
checkpoint payload) into its own memory every few steps (Coordinator._keep_in_memory), so a stage that is
lost does not take the run's state with it. When a stage's device is lost (its process killed by a signal,
silent past runtime.failure_timeout_s, its connection gone for good), the run:

1. stops every stage, as any failed run does;
2. re-plans on the devices left, in the same pipeline order (planner/recovery.py: the split simulated at the
   speeds the run measured), and writes that plan as RUN_DIR/plan-recovery-N.json;
3. starts the stages of the new plan, hands each its layers' state from the newest copy, and trains on from
   the step after it: the steps since the copy are trained again, with the same data (a function of the step
   number), so the losses are those of a run that lost nothing.

Each recovery is a line in metrics.jsonl (``"event": "recovery"``) and in the report. A stage that failed with
an error of its own (an exception, an exit code) is not a lost device: the run stops, as with
runtime.elastic=off. After runtime.max_recoveries recoveries the next loss stops the run with the resume command.

Recovery restarts stages on this host only: a plan whose remaining stages run on other hosts stops as before
(their `hetero worker` would need the new plan), and says so.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError
from hetero.plan import Plan
from hetero.runtime.run.moves import split_of
from hetero.runtime.run.options import RunOptions
from hetero.runtime.run.processes import StageFailedError
from hetero.runtime.run.records import RunResult


def run_elastic(plan: Plan, plan_path: Path, options: RunOptions) -> tuple[Plan, Path, RunResult]:
    """Train ``plan`` to its end, recovering from lost devices (runtime.elastic=auto); returns the plan the run ended
    on, its plan.json and the result (its events: every recovery's). Raises the one-line error of a failure it
    does not recover from."""
    from hetero.runtime.run.coordinator import Coordinator

    done = 0  # recoveries made
    earlier: list[dict[str, Any]] = []  # the recovery lines that the coordinators before the last one wrote
    while True:
        coordinator = Coordinator(plan, plan_path, options)
        try:
            result = coordinator.run()
        except StageFailedError as exc:
            recovered = _recover(coordinator, exc, options, done)
            if recovered is None:
                raise
            earlier += [e for e in coordinator.result.events if e.get("event") == "recovery"]
            plan, plan_path, options = recovered
            done += 1
            continue
        result.events[:0] = earlier
        return plan, plan_path, result


def _recover(coordinator: Any, exc: StageFailedError, options: RunOptions,
             done: int) -> tuple[Plan, Path, RunOptions] | None:
    """The plan, its path and the options to go on with after ``exc``; None (said on stderr when it is a loss) to
    stop with ``exc``."""
    from hetero.planner.recovery import plan_without

    lost = exc.lost
    if options.elastic != "auto" or lost is None or not coordinator.trained:
        return None  # before training began, a failure is a setup problem: it would fail again
    plan: Plan = coordinator.plan
    device = plan.stages[lost.stage].device
    if done >= options.max_recoveries:
        print(f"hetero run: runtime.elastic: {done} recover{'y' if done == 1 else 'ies'} made "
              f"(runtime.max_recoveries={options.max_recoveries}): not going on without {device}",
              file=sys.stderr, flush=True)
        return None
    host = coordinator.host
    try:
        recovery = plan_without(plan, {device}, coordinator.mover.measured_factors())
    except HeteroError as why:
        print(f"hetero run: runtime.elastic: cannot go on without {device}: {why}", file=sys.stderr, flush=True)
        return None
    remote = sorted({s.host for s in recovery.plan.stages if s.host != host})
    if remote or coordinator.ssh is not None:
        print(f"hetero run: runtime.elastic: cannot go on without {device}: stages left on "
              f"{', '.join(remote) or 'hosts started over ssh'} would need the new plan (recovery restarts stages on "
              "this host only)", file=sys.stderr, flush=True)
        return None
    number = done + 1
    path = options.run_dir / f"plan-recovery-{number}.json"
    recovery.plan.save(path)
    memory = coordinator.memory
    resumed = int(memory[1]["step"]) if memory is not None else 0
    last = coordinator.result.steps[-1]["step"] if coordinator.result.steps else resumed - 1
    event = {
        "event": "recovery", "after_step": int(last), "recovery": number, "stage": lost.stage, "device": device,
        "host": plan.stages[lost.stage].host, "cause": f"{lost.what}: {lost.cause}", "resumed_from_step": resumed,
        "replayed_steps": max(0, int(last) + 1 - resumed), "old_split": split_of(plan),
        "new_split": recovery.split, "devices": recovery.devices, "plan": path.name,
        "predicted_step_s_after": recovery.predicted_step_s, "lost_at": lost.at,
    }
    print(f"hetero run: stage {lost.stage} ({device} on {event['host']}) {lost.what}: {lost.cause}; going on without "
          f"it on {len(recovery.devices)} stage(s), split {'/'.join(map(str, recovery.split))}, from step {resumed} "
          f"({event['replayed_steps']} step(s) trained again); plan {path} (recovery {number} of at most "
          f"{options.max_recoveries}: runtime.max_recoveries)", file=sys.stderr, flush=True)
    # The coordinator stays where it was (its endpoint is the one every stage dials), whichever stage is first now.
    where = options.host if options.host is not None or recovery.plan.stages[0].host == host else host
    # The launcher forks once (launcher.py): the new stages start as fresh interpreters.
    return recovery.plan, path, replace(options, host=where, resume=None, checkpoint=memory, recovery=event,
                                        launcher=None)
