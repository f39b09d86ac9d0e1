"""What-if comparisons for `hetero simulate`: another schedule, more micro-batches, one device removed.

The first two re-simulate the plan's own per-stage times (the placement stays); memory is rescaled
by how many micro-batches each stage then holds. Removing a device re-plans on the smaller fleet
with the same cost model (datasheets, or the profile the plan was compiled with).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hetero.errors import HeteroError
from hetero.plan import Plan
from hetero.planner.model.cost import in_flight
from hetero.planner.model.cost_model import CostModel
from hetero.planner.schedule.simulator import Timeline, plan_core_share, simulate, virtual_times
from hetero.planner.schedule.step_form import SCHEDULES, peak_activations, programs_for, step_form


@dataclass
class WhatIf:
    name: str  # "schedule=gpipe", "num_micro_batches=16", "without box1.gpu0"
    description: str
    feasible: bool
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    bubble_fraction: float | None = None
    peak_memory_gb: list[float] | None = None  # per stage
    reason: str = ""  # why infeasible

    def versus(self, plan: Plan) -> str:
        """One line comparing this alternative with the plan."""
        if not self.feasible or self.tokens_per_s is None or self.step_time_s is None:
            return f"{self.name}: not possible ({self.reason})"
        ratio = self.tokens_per_s / plan.prediction.tokens_per_s if plan.prediction.tokens_per_s else 0.0
        bubble = f", bubble {self.bubble_fraction:.0%}" if self.bubble_fraction is not None else ""
        return (f"{self.name}: {self.step_time_s:.3g} s/step, {ratio:.2f}x the plan's tokens/s{bubble} "
                f"({self.description})")


def _stage_times(plan: Plan) -> tuple[list[float], list[float], list[float]]:
    return ([s.fwd_time_s for s in plan.stages], [s.bwd_time_s for s in plan.stages],
            [s.send_time_s for s in plan.stages])


def _interleaved_more(plan: Plan, name: str, description: str, m: int) -> WhatIf:
    """An interleaved plan (stages holding chunks) with ``m`` micro-batches: its programs for them re-simulated on
    its per-chunk times, and each device's activations at the peak of its new program, each chunk at the bytes per
    micro-batch the plan priced it at, with the plan's recomputing layers (planner/search/interleave.py; where the device
    would not fit, the planner might recompute more). A plan without those (from before they were recorded) scales
    each device's activations with the (micro-batch, chunk) units it then holds: an estimate."""
    p, v = len(plan.stages), len(plan.stages[0].spans())
    form = step_form(plan.train.schedule).chunked
    if form is None or form.chunks != v:
        return WhatIf(name, description, False, reason=f"train.schedule={plan.train.schedule} has no form of {v} "
                      "chunks per device in this hetero: compile the plan again")
    why = form.why_not(p, m)
    if why is not None:
        return WhatIf(name, description, False, reason=why)
    fwd, bwd, send = virtual_times(plan.stages)
    common = {"overhead_s": [dict(s.overhead_s) for s in plan.stages], "sync_s": [s.step_sync_s for s in plan.stages],
              "cores": plan_core_share(plan, list(range(p)))}
    programs = form.programs(p, m)
    timeline = simulate(programs, fwd, bwd, send, **common)  # type: ignore[arg-type]
    if all(len(s.memory.chunk_gb_per_mb) == v for s in plan.stages):
        peaks = [s.memory.total_gb - s.memory.activations_gb + s.memory.working_gb
                 + peak_activations(program, list(s.memory.chunk_gb_per_mb))
                 for s, program in zip(plan.stages, programs, strict=True)]
    else:
        now = simulate([s.actions() for s in plan.stages], fwd, bwd, send, **common)  # type: ignore[arg-type]
        peaks = [s.memory.total_gb + s.memory.activations_gb * (new / max(old, 1) - 1)
                 for s, old, new in zip(plan.stages, now.peak_in_flight, timeline.peak_in_flight, strict=True)]
    reasons = [f"stage {k} on {s.device} would need {peak:.1f} GB of {s.memory.available_gb:.1f} GB"
               for k, (s, peak) in enumerate(zip(plan.stages, peaks, strict=True)) if peak > s.memory.available_gb]
    tokens = plan.prediction.tokens_per_step // max(plan.train.num_micro_batches, 1) * m
    step = timeline.step_time_s
    return WhatIf(name, description, not reasons, step, tokens / step if step > 0 else None,
                  timeline.bubble_fraction, peaks, "; ".join(reasons))


def _resimulated(plan: Plan, name: str, description: str, schedule: str, m: int) -> WhatIf:
    """The same placement and stage times under another schedule or micro-batch count."""
    if any(s.chunks for s in plan.stages):
        if schedule == plan.train.schedule:
            return _interleaved_more(plan, name, description, m)
        return WhatIf(name, description, False, reason="the plan's devices hold chunks of layers (planner.interleave); "
                      "compile with planner.interleave=off to compare schedules of one chunk per device")
    num_stages = len(plan.stages)
    fwd, bwd, send = _stage_times(plan)
    timeline = simulate(programs_for(schedule, num_stages, m), fwd, bwd, send,
                        overhead_s=[dict(s.overhead_s) for s in plan.stages],
                        sync_s=[s.step_sync_s for s in plan.stages],
                        cores=plan_core_share(plan, list(range(num_stages))))
    tokens = plan.prediction.tokens_per_step // max(plan.train.num_micro_batches, 1) * m
    peaks, reasons = [], []
    for k, sp in enumerate(plan.stages):
        pos = num_stages - 1 - k
        held_now = in_flight(plan.train.schedule, pos, plan.train.num_micro_batches)
        held_new = in_flight(schedule, pos, m)
        mem = sp.memory
        total = mem.total_gb - mem.activations_gb + mem.activations_gb / max(held_now, 1) * held_new
        peaks.append(total)
        if total > mem.available_gb:
            reasons.append(f"stage {k} on {sp.device} would need {total:.1f} GB of {mem.available_gb:.1f} GB")
    step = timeline.step_time_s
    return WhatIf(name, description, not reasons, step, tokens / step if step > 0 else None,
                  timeline.bubble_fraction, peaks, "; ".join(reasons))


def other_schedules(plan: Plan) -> list[WhatIf]:
    """The plan's placement under each schedule it does not use."""
    return [_resimulated(plan, f"schedule={s}", "same placement and micro-batches", s, plan.train.num_micro_batches)
            for s in SCHEDULES if s != plan.train.schedule]


def more_micro_batches(plan: Plan, factors: tuple[int, ...] = (2, 4)) -> list[WhatIf]:
    """The same placement with ``factor`` times the micro-batches per step (same micro-batch size)."""
    m = plan.train.num_micro_batches
    return [_resimulated(plan, f"num_micro_batches={m * f}", f"{f}x the micro-batches of the same size per step",
                         plan.train.schedule, m * f) for f in factors]


def without_device(plan: Plan, device: str, cost_model: CostModel | None = None,
                   time_limit_s: float = 5.0) -> WhatIf:
    """Re-plan on the fleet minus ``device`` (same model, training keys and cost model)."""
    from hetero.planner import plan as make_plan

    cluster = replace(plan.cluster, hosts=[replace(h, devices=[d for d in h.devices if d.name != device])
                                           for h in plan.cluster.hosts])
    name = f"without {device}"
    if not cluster.devices:
        return WhatIf(name, "re-planned", False, reason="no device left")
    options = replace(plan.planner, split=None, devices=None, time_limit_s=min(plan.planner.time_limit_s, time_limit_s),
                      num_stages=None)
    try:
        other = make_plan(plan.model, plan.graph, cluster, plan.train, plan.data, options, cost_model=cost_model,
                          evaluation=plan.eval if plan.eval.device != device else None, security=plan.security.mode)
    except HeteroError as exc:
        return WhatIf(name, "re-planned", False, reason=str(exc).split("\n")[0])
    p = other.prediction
    return WhatIf(name, f"re-planned on {len(other.stages)} stage(s): " + ", ".join(s.device for s in other.stages),
                  True, p.step_time_s, p.tokens_per_s, p.bubble_fraction, p.stage_memory_gb)


def what_ifs(plan: Plan, cost_model: CostModel | None = None, replan: bool = True) -> list[WhatIf]:
    """Every comparison `hetero simulate` prints: schedules, micro-batches, each used device removed."""
    out = other_schedules(plan) + more_micro_batches(plan)
    if replan and len(plan.cluster.devices) > 1:
        out += [without_device(plan, s.device, cost_model) for s in plan.stages]
    return out


def _per_micro_batch(plan: Plan, k: int, timeline: Timeline) -> tuple[list[float], float]:
    """Stage k's GB per micro-batch in each of its chunks, and the GB it holds whatever is in flight."""
    sp, mem = plan.stages[k], plan.stages[k].memory
    fixed = mem.total_gb - mem.activations_gb
    if sp.chunks and len(mem.chunk_gb_per_mb) == len(sp.spans()):  # each chunk at its own bytes per micro-batch,
        return list(mem.chunk_gb_per_mb), fixed + mem.working_gb  # a re-run's working bytes kept aside
    if sp.chunks:  # an interleaved plan from before those were recorded: the device's peak spread evenly over the
        planned = max(1, timeline.peak_in_flight[k])  # (micro-batch, chunk) units it then holds
    else:  # in flight within its own pipeline, over its own share of the step
        _, rep, pos = plan.replica_of(k)
        planned = max(1, in_flight(plan.train.schedule, len(rep.stages) - 1 - pos, rep.num_micro_batches))
    return [mem.activations_gb / planned] * len(sp.spans()), fixed


def memory_over_time(plan: Plan, timeline: Timeline) -> list[list[tuple[float, float]]]:
    """Per stage, (time, GB) points: fixed memory plus saved activations of micro-batches in flight."""
    out = []
    for k in range(len(plan.stages)):
        per_mb, fixed = _per_micro_batch(plan, k, timeline)
        level, points = fixed, [(0.0, fixed)]
        for e in timeline.stage_events(k):
            # Activations are saved as the forward runs and freed when the backward finishes.
            if e.op == "F":
                points.append((e.start_s, level))
                level += per_mb[e.chunk]
                points.append((e.end_s, level))
            elif e.op == "B":
                points.append((e.end_s, level))
                level -= per_mb[e.chunk]
                points.append((e.end_s, level))
        points.append((timeline.step_time_s, level))
        out.append(points)
    return out


CHEAP_SHARE = 0.05  # a device whose removal costs under this share of the step is named, with how to drop it


def cheap_device_lines(plan: Plan, cost_model: CostModel | None = None, budget_s: float = 10.0) -> list[str]:
    """A verdict line for each training device without which the re-planned step is under CHEAP_SHARE slower (or
    faster): a card that relays a layer or two over another network hop adds little and can stop a run when its
    box goes away. Each re-plan gets at most a quarter of the plan's time limit, all of them ``budget_s``."""
    deadline = time.perf_counter() + budget_s
    step = plan.prediction.step_time_s
    used = list(dict.fromkeys(s.device for s in plan.stages))
    if len(used) < 2 or step <= 0:
        return []
    lines = []
    for device in used:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        other = without_device(plan, device, cost_model, time_limit_s=min(left, plan.planner.time_limit_s / 4, 5.0))
        if not other.feasible or other.step_time_s is None or other.step_time_s > step * (1 + CHEAP_SHARE):
            continue
        ratio = other.step_time_s / step
        words = (f"costs {ratio - 1:.0%} of the step" if ratio >= 1.005 else "costs nothing measurable" if ratio > 0.995
                 else f"is {1 - ratio:.0%} faster")
        excluded = [*plan.planner.exclude, device]
        lines.append(f"{device} adds little: without it the plan takes {other.step_time_s:.3g} s/step against "
                     f"{step:.3g} s ({ratio:.2f}x; leaving it out {words}); to leave it out, recompile with "
                     f"planner.exclude=[{','.join(excluded)}]")
    return lines
