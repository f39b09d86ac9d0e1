"""Recovery without a person (`hetero run ... runtime.elastic=auto`, the default).

While it trains, the coordinator copies every stage's state (LoRA weights, AdamW moments, step count: the
checkpoint payload) into its own memory every few steps (StateKeeper.keep: runtime/run/coordinator_state.py), so a stage that is
lost does not take the run's state with it. When a stage's device is lost (its process killed by a signal,
silent past runtime.failure_timeout_s, its connection gone for good), the run:

1. stops every stage, as any failed run does;
2. re-plans on the devices left, in the same pipeline order (planner/replan/recovery.py: the split simulated at the
   speeds the run measured), and writes that plan as RUN_DIR/plan-recovery-N.json;
3. starts the stages of the new plan, hands each its layers' state from the newest copy, and trains on from
   the step after it: the steps since the copy are trained again, with the same data (a function of the step
   number), so the losses are those of a run that lost nothing.

Stages on other hosts follow too: the coordinator's stop tells each of them the new plan (plan.json's text,
on the authenticated wire), the stage leaves it in its worker's run directory and exits with EXIT_REPLAN, and the
worker (`hetero worker --host`, runtime/run/host.py) starts its host's stages of it. A stage keeps its process name
(its key) on every plan of the run, whatever its index (StagePlan.name), so each host's keys stay valid.

Rejoin: a lost device's stage started again (its host's `hetero worker` with the run's first plan.json, or any plan
of the run) says hello under that plan; the coordinator cannot take it, but it learns from the drop, authenticated
by the stage's key, that the device is back. At the next step boundary it plans the run on the devices it has and
the ones back, and when that plan is predicted faster (REJOIN_GAIN), it copies the stages' state at that boundary
and goes on under it: the stage that came back is told the plan under its own plan's hash, and its worker starts
it. No step is trained twice. A device lost MAX_DEVICE_LOSSES times is not taken back (said once).

Each recovery and rejoin is a line in metrics.jsonl (``"event": "recovery"``, ``"kind": "rejoin"`` for a return)
and in the report. A stage that failed with an error of its own (an exception, an exit code) is not a lost device:
the run stops, as with runtime.elastic=off. After runtime.max_recoveries re-plans the next loss stops the run with
the resume command.

Hosts that `hetero run` started over ssh (runtime/run/ssh.py) follow the same way: their workers keep their ssh
sessions across plans (the next coordinator takes them over), and a host whose worker ended is a loss of its devices.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetero.errors import HeteroError
from hetero.plan import Plan
from hetero.protocol import MAX_HEADER_BYTES
from hetero.runtime.base.processes import StageFailedError
from hetero.runtime.run.metrics_file import Event, RebalanceEvent, RecoveryEvent
from hetero.runtime.run.moves import split_of
from hetero.runtime.run.options import RunOptions
from hetero.runtime.run.records import RunResult

REJOIN_GAIN = 0.97  # a device that is back is taken when the plan with it is predicted this much faster, or more
MAX_DEVICE_LOSSES = 2  # a device lost this often is not taken back

MAX_PLAN_BYTES = MAX_HEADER_BYTES - (64 << 10)  # a re-plan travels in a stop message's header, with room for the rest


def run_elastic(plan: Plan, plan_path: Path, options: RunOptions) -> tuple[Plan, Path, RunResult]:
    """Train ``plan`` to its end, recovering from lost devices (runtime.elastic=auto); returns the plan the run ended
    on, its plan.json and the result (its events: every recovery's). Raises the one-line error of a failure it
    does not recover from."""
    from hetero.runtime.run.coordinator import Coordinator

    done = 0  # re-plans made (after losses, for devices back, and rebalancing re-plans: RunOptions.replans_made)
    earlier: list[Event] = []  # the recovery lines that the coordinators before the last one wrote
    history = Lineage([plan])
    while True:
        coordinator = Coordinator(plan, plan_path, options)
        coordinator.failures.on_loss = lambda exc, c=coordinator, o=options, n=done: _recover(c, exc, o, n, history)  # type: ignore[misc]
        if options.elastic == "auto":
            coordinator.on_return = lambda c=coordinator, o=options, n=done: _rejoin(c, history, o, n)  # type: ignore[misc]
        try:
            result = coordinator.run()
        except StageFailedError:
            recovered = coordinator.failures.recovered  # planned while the stages stopped: the remote ones got its plan
            if recovered is None:
                raise
            history.losses.update(recovered[2].recovery.lost_devices or [])  # type: ignore[union-attr]
        except Rejoining as back:
            where = options.host if options.host is not None else coordinator.host
            moved = isinstance(back.event, RebalanceEvent)  # a re-plan move is no recovery (runtime.max_recoveries)
            recovered = (back.plan, back.path, replace(options, host=where, resume=None, checkpoint=coordinator.keeper.memory,
                                                       recovery=back.event, launcher=None,
                                                       ssh_workers=coordinator.link.ssh,
                                                       replans_made=options.replans_made + moved))
        else:
            result.events[:0] = earlier
            return plan, plan_path, result
        earlier += [e for e in coordinator.result.events if isinstance(e, RecoveryEvent)]
        plan, plan_path, options = recovered
        history.plans.append(plan)
        options = replace(options, earlier_plans=tuple(p.input_hash for p in history.plans[:-1]))
        done += 1


def completed(event: RecoveryEvent | RebalanceEvent) -> RecoveryEvent | RebalanceEvent:
    """The recovery (or re-plan move) a run goes on from, after its first step on the new plan: with the seconds
    from the loss (the stages' stop) to that step."""
    if isinstance(event, RebalanceEvent) and event.started_at is not None:
        return replace(event, move_s=round(time.monotonic() - event.started_at, 3), started_at=None)
    if isinstance(event, RecoveryEvent) and event.lost_at is not None:
        return replace(event, recovery_s=round(time.monotonic() - event.lost_at, 3), lost_at=None)
    return event


class Lineage:
    """The plans a run went through (its first first), and how often each device was lost."""

    def __init__(self, plans: list[Plan]) -> None:
        self.plans = plans
        self.losses: Counter[str] = Counter()
        self.said: set[str] = set()  # lines said once
        self.declined: set[tuple[str, frozenset[str]]] = set()  # (plan hash, devices back) not worth a re-plan
        self.factors: dict[str, float] = {}  # device -> compute measured over priced, newest measurement

    def speeds(self, coordinator: Any) -> dict[str, float]:
        """Every device's measured speed factor: this coordinator's measurements over earlier ones; a device never
        measured (or not since the run's plans changed) gets the median of the others (priced as wrong as they are)."""
        self.factors.update(coordinator.mover.measured_factors())
        known = sorted(self.factors.values())
        typical = known[len(known) // 2] if known else 1.0
        return {s.device: self.factors.get(s.device, typical) for s in self.plans[0].stages}

    def say(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            print(f"hetero run: runtime.elastic: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Joiner:
    """A stage of an earlier plan of the run that says hello again: where it listens, and under which plan."""

    name: str
    device: str
    endpoint: str
    plan_hash: str


class Rejoining(Exception):  # noqa: N818 (a turn of the run, not an error)
    """Raised by the coordinator at a step boundary, with the stages' state copied: the run goes on under ``plan``,
    with the devices that came back (none: a rebalancing re-plan on the same devices, ``event`` its move)."""

    def __init__(self, plan: Plan, path: Path, event: RecoveryEvent | RebalanceEvent, joiners: list[Joiner]) -> None:
        super().__init__(f"the run goes on under {path.name}"
                         + (f" with {', '.join(j.device for j in joiners)}" if joiners else ""))
        self.plan, self.path, self.event, self.joiners = plan, path, event, joiners


def returning(coordinator: Any, history: Lineage) -> list[Joiner]:
    """The lost devices whose stage says hello again under an earlier plan of the run (the coordinator's transport
    dropped it for its plan hash; with keys, the drop names the process the key proves)."""
    from hetero.runtime.wire.frames import plan_mismatch

    plan: Plan = coordinator.plan
    current, devices = set(plan.stage_ids()), {s.device for s in plan.stages}
    by_hash = {p.input_hash: p for p in history.plans}
    keyed = plan.security.mode != "none"
    found: dict[str, Joiner] = {}
    for peer, why in list(coordinator.link.transport.rejections):
        mismatch = plan_mismatch(why)
        if mismatch is None:
            continue
        name = peer if keyed else mismatch[0]
        old = by_hash.get(mismatch[1])
        k = old.stage_named(name) if old is not None and name not in current else None
        if old is None or k is None or old.stages[k].device in devices:
            continue
        device = old.stages[k].device
        if history.losses[device] >= MAX_DEVICE_LOSSES:
            history.say(f"{device} is back, but it was lost {history.losses[device]} times: left out of the run")
            continue
        found[name] = Joiner(name, device, old.stages[k].endpoint, mismatch[1])
    return list(found.values())


def _rejoin(coordinator: Any, history: Lineage, options: RunOptions, done: int) -> Rejoining | None:
    """The plan with the devices that came back, when it is predicted faster than the current one (saved as the
    run's next plan); None to go on as it is."""
    from hetero.planner.replan.recovery import plan_without, simulated_step_s

    joiners = returning(coordinator, history)
    if not joiners:
        return None
    back = ", ".join(j.device for j in joiners)
    asked = (coordinator.plan.input_hash, frozenset(j.device for j in joiners))
    if asked in history.declined:  # its heartbeats keep being dropped: decided already
        return None
    history.declined.add(asked)  # taken back below when it is not declined
    if done - options.replans_made >= options.max_recoveries:
        history.say(f"{back} is back, but the run re-planned {done - options.replans_made} times after losses "
                    f"(runtime.max_recoveries={options.max_recoveries}): going on without it")
        return None
    plan: Plan = coordinator.plan
    first = history.plans[0]
    everyone = {s.device for s in first.stages}
    keep = {s.device for s in plan.stages} | {j.device for j in joiners}
    speeds = history.speeds(coordinator)
    # Compared at the speeds the run measured (the plan without it re-simulated the same way), or, for replicas,
    # as the solver prices both plans.
    before = simulated_step_s(first, everyone - {s.device for s in plan.stages}, speeds)
    after = simulated_step_s(first, everyone - keep, speeds)
    if before is None or after is None:
        before, after = plan.prediction.step_time_s, None
    if after is not None and after > before * REJOIN_GAIN:
        history.say(f"{back} is back; the plan with it simulates {after:.3g} s a step against {before:.3g} s now "
                    "(at the speeds this run measured): going on without it")
        return None
    try:
        new = plan_without(first, everyone - keep, speeds)
    except HeteroError as why:
        history.say(f"{back} is back, but cannot be planned in: {why}")
        return None
    if after is None:
        after = new.plan.prediction.step_time_s
        if after > before * REJOIN_GAIN:
            history.say(f"{back} is back; the plan with it predicts {after:.3g} s a step against {before:.3g} s now: "
                        "going on without it")
            return None
    history.declined.discard(asked)
    number = done + 1
    path = options.run_dir / f"plan-recovery-{number}.json"
    new.plan.save(path)
    if len(path.read_bytes()) > MAX_PLAN_BYTES:
        history.say(f"{back} is back, but the plan with it ({path}) is larger than a message may carry to the other "
                    "hosts: going on without it")
        history.declined.add(asked)
        return None
    return _rejoining(coordinator, first, joiners, new, path, number, before, after)


def _rejoining(coordinator: Any, first: Plan, joiners: list[Any], new: Any, path: Path, number: int, before: float,
               after: float) -> Rejoining:
    """The run's move onto the plan with the devices that came back: its recovery event, said on stderr."""
    back = ", ".join(j.device for j in joiners)
    steps = coordinator.result.steps
    last = steps[-1].step if steps else coordinator.start_step  # steps done (records.STEP_NUMBERS)
    devices = {s.device: s for s in first.stages}
    event = RecoveryEvent(
        kind="rejoin", after_step=last, recovery=number, device=back,
        host=", ".join(sorted({devices[j.device].host for j in joiners})), cause="back: its stage said hello again",
        resumed_from_step=last + 1, replayed_steps=0, old_split=split_of(coordinator.plan), new_split=new.split,
        devices=new.devices, plan=path.name, step_s_before=before, step_s_after=after,
        predicted_step_s_after=new.plan.prediction.step_time_s, lost_at=time.monotonic())
    print(f"hetero run: {back} is back: going on with it after step {last}, split {'/'.join(map(str, new.split))} "
          f"on {len(new.devices)} stage(s), {after:.3g} s a step against {before:.3g} s now (simulated at the speeds "
          f"this run measured); plan {path}",
          file=sys.stderr, flush=True)
    return Rejoining(new.plan, path, event, joiners)


def _recover(coordinator: Any, exc: StageFailedError, options: RunOptions, done: int,
             history: Lineage) -> tuple[Plan, Path, RunOptions] | None:
    """The plan, its path and the options to go on with after ``exc``; None (said on stderr when it is a loss) to
    stop with ``exc``."""
    from hetero.planner.replan.recovery import plan_without

    lost = exc.lost
    if options.elastic != "auto" or lost is None or not coordinator.failures.trained:
        return None  # before training began, a failure is a setup problem: it would fail again
    plan: Plan = coordinator.plan
    device = plan.stages[lost.stage].device
    made = done - options.replans_made  # rebalancing re-plans are no recoveries
    if made >= options.max_recoveries:
        print(f"hetero run: runtime.elastic: {made} recover{'y' if made == 1 else 'ies'} made "
              f"(runtime.max_recoveries={options.max_recoveries}): not going on without {device}",
              file=sys.stderr, flush=True)
        return None
    host = coordinator.host
    try:
        gone = [device, *(plan.stages[j].device for j in lost.others)]
        recovery = plan_without(plan, set(gone), history.speeds(coordinator))
    except HeteroError as why:
        print(f"hetero run: runtime.elastic: cannot go on without {device}: {why}", file=sys.stderr, flush=True)
        return None
    number = done + 1
    path = options.run_dir / f"plan-recovery-{number}.json"
    recovery.plan.save(path)
    if len(path.read_bytes()) > MAX_PLAN_BYTES:
        print(f"hetero run: runtime.elastic: cannot go on without {device}: the new plan ({path}) is larger than a "
              f"message may carry to the other hosts", file=sys.stderr, flush=True)
        return None
    memory = coordinator.keeper.memory
    resumed = int(memory[1]["step"]) if memory is not None else 0
    last = coordinator.result.steps[-1].step if coordinator.result.steps else resumed  # steps done, as ``resumed``
    event = RecoveryEvent(
        after_step=last, recovery=number, stage=lost.stage, device=device, lost_devices=gone,
        host=plan.stages[lost.stage].host, cause=f"{lost.what}: {lost.cause}", resumed_from_step=resumed + 1,
        replayed_steps=max(0, last - resumed), old_split=split_of(plan), new_split=recovery.split,
        devices=recovery.devices, plan=path.name, predicted_step_s_after=recovery.predicted_step_s, lost_at=lost.at)
    print(f"hetero run: stage {lost.stage} ({device} on {event.host}) {lost.what}: {lost.cause}; going on without "
          f"it on {len(recovery.devices)} stage(s), split {'/'.join(map(str, recovery.split))}, from step {resumed + 1} "
          f"({event.replayed_steps} step(s) trained again); plan {path} (recovery {made + 1} of at most "
          f"{options.max_recoveries}: runtime.max_recoveries)", file=sys.stderr, flush=True)
    # The coordinator stays where it was (its endpoint is the one every stage dials), whichever stage is first now.
    where = options.host if options.host is not None or recovery.plan.stages[0].host == host else host
    # The launcher forks once (launcher.py): the new stages start as fresh interpreters.
    # Workers started over ssh follow the new plan: the next coordinator keeps their sessions.
    return recovery.plan, path, replace(options, host=where, resume=None, checkpoint=memory, recovery=event,
                                        launcher=None, ssh_workers=coordinator.link.ssh)
