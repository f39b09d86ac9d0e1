"""CPU stages that share too few cores: the fleet knows a host's cores, the simulator lets no more stages compute
at once than the host has cores, and a run's profile prices such a stage by its own CPU time, not by a wall time
that includes its waits for a core (planner/schedule/simulator.py CoreShare, runtime/run/run_profile.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from metrics_rows import step_line

from hetero.errors import ConfigError
from hetero.planner.schedule.simulator import CoreShare, core_share, simulate
from hetero.planner.schedule.step_form import programs_for
from hetero.profile import SHARED_CORES_NOTE, Profile
from hetero.serde import to_dict
from hetero.specs import ModelSpec


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_three_stages_on_two_cores_share_them(schedule: str) -> None:
    """Processor sharing: the step is at least the host's work over its cores and at most the unshared step
    slowed by the oversubscription (3 threads on 2 cores: 1.5x); a host with enough cores is the plain
    simulation; an action that overlaps nothing is not slowed."""
    m, f, b = 8, 1.0, 2.0
    programs = programs_for(schedule, 3, m)
    alone = simulate(programs, [f] * 3, [b] * 3, [0.01] * 3)
    share = core_share(["h", "h", "h"], [1, 1, 1], {"h": 2})
    assert share == CoreShare((0, 0, 0), (1, 1, 1), (2,))
    shared = simulate(programs, [f] * 3, [b] * 3, [0.01] * 3, cores=share)
    assert shared.step_time_s >= 3 * m * (f + b) / 2 - 1e-9  # the host's work over its 2 cores
    assert alone.step_time_s * 1.2 < shared.step_time_s <= alone.step_time_s * 1.5 + 1e-9
    first = min((e for e in shared.events if e.op == "F"), key=lambda e: e.start_s)
    assert first.end_s - first.start_s == pytest.approx(f)  # stage 0's first forward runs alone, at full speed
    assert core_share(["h", "h", "h"], [1, 1, 1], {"h": 3}) is None
    assert core_share(["h", "h", "h"], [1, 1, 1], {}) is None  # cores not known: nobody waits
    one = programs_for(schedule, 3, 1)  # one micro-batch: the stages never compute at once
    assert simulate(one, [f] * 3, [b] * 3, [0.01] * 3, cores=share).step_time_s == pytest.approx(
        simulate(one, [f] * 3, [b] * 3, [0.01] * 3).step_time_s)


def test_only_cpu_stages_on_a_short_host_share() -> None:
    """A GPU stage (no threads) and a stage on a roomy host compete with nobody; need is capped at the cores."""
    share = core_share(["a", "a", "a", "b"], [0, 4, 4, 1], {"a": 6, "b": 8})
    assert share == CoreShare((-1, 0, 0, -1), (0, 4, 4, 1), (6,))
    programs = programs_for("1f1b", 4, 4)
    timeline = simulate(programs, [1.0] * 4, [2.0] * 4, [0.0] * 4, cores=share)
    f1 = next(e for e in timeline.events if e.stage == 1 and e.op == "F" and e.mb == 0)
    f2 = next(e for e in timeline.events if e.stage == 2 and e.op == "F" and e.mb == 0)
    assert f1.end_s - f1.start_s == pytest.approx(1.0)  # stage 2 not yet computing: full speed
    assert f2.end_s - f2.start_s > 1.0  # beside stage 1's work: 8 threads on 6 cores
    with pytest.raises(Exception, match="core-share"):
        simulate(programs, [1.0] * 4, [2.0] * 4, [0.0] * 4, cores=CoreShare((0,), (1,), (1,)))


def _fleet(hosts: list[dict]):
    from hetero.hardware import build_cluster, load_device_types

    return build_cluster({"name": "f", "hosts": hosts}, load_device_types())


def test_a_hosts_cores_come_from_the_fleet_or_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cores:`` in the fleet file is the host's; default threads split it; without it the host has this
    machine's cores only where a stage took its threads from them; a bad value is one line."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    local = _fleet([{"name": "l", "devices": [{"type": "cpu", "count": 3}]}])
    assert local.hosts[0].cores == 2 and [d.threads for d in local.devices] == [1, 1, 1]
    declared = _fleet([{"name": "r", "address": "10.0.0.2", "cores": 16, "devices": [{"type": "cpu", "count": 2}]}])
    assert declared.hosts[0].cores == 16 and [d.threads for d in declared.devices] == [8, 8]
    explicit = _fleet([{"name": "r", "devices": [{"type": "cpu", "threads": 4}]}])
    assert explicit.hosts[0].cores is None  # threads given, cores not: not known
    with pytest.raises(ConfigError, match=r"hosts\[0\]\.cores"):
        _fleet([{"name": "r", "cores": 0, "devices": [{"type": "cpu"}]}])


def test_the_planner_prices_the_shared_cores(monkeypatch: pytest.MonkeyPatch, tiny_spec: ModelSpec) -> None:
    """The same three one-thread stages on a 2-core host simulate slower than on a host said to have 3 cores, and
    the simulator's lower bound still holds."""
    from hetero.compiler.trace import trace
    from hetero.planner.model.cost import build_cost_table
    from hetero.planner.model.cost_model import RooflineCostModel
    from hetero.planner.model.objective import Placement, evaluate, split_spans
    from hetero.planner.model.predict import predict
    from hetero.planner.search.simbound import lower_bound_s
    from hetero.specs import PlannerOptions, TrainSpec

    graph = trace(tiny_spec)
    train = TrainSpec(micro_batch_size=4, num_micro_batches=8)
    steps = {}
    for cores in (2, 3):
        cluster = _fleet([{"name": "l", "cores": cores, "devices": [{"type": "cpu", "threads": 1, "count": 3}]}])
        table = build_cost_table(graph, tiny_spec, cluster, train, PlannerOptions(), RooflineCostModel())
        decoders = [i for i, n in enumerate(graph.nodes) if n.kind == "decoder"]
        placement = Placement((0, 1, 2), tuple(split_spans(len(graph.nodes), [len(decoders) // 3, len(decoders) // 3, len(decoders) - 2 * (len(decoders) // 3)], decoders)))
        ev = evaluate(table, placement)
        assert (ev.cores is not None) == (cores == 2)
        steps[cores] = predict(table, ev)[0].step_time_s
        assert lower_bound_s(table, ev) <= steps[cores] + 1e-12
    # (not 1.5x: the last stage, with the loss head, outweighs the others, and it keeps its own core more often)
    assert steps[2] > steps[3] * 1.1


def _three_stage_plan(monkeypatch: pytest.MonkeyPatch, tiny_spec: ModelSpec):
    import os

    from hetero.compiler.trace import trace
    from hetero.planner import plan as make_plan
    from hetero.specs import DataSpec, PlannerOptions, TrainSpec

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cluster = _fleet([{"name": "localhost", "devices": [{"type": "cpu", "count": 3}]}])
    return make_plan(tiny_spec, trace(tiny_spec), cluster, TrainSpec(micro_batch_size=4, num_micro_batches=4),
                     DataSpec(), PlannerOptions(num_stages=3, time_limit_s=10))


def test_a_shared_core_stage_is_profiled_by_its_cpu_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         tiny_spec: ModelSpec) -> None:
    """Three one-thread stages on 2 cores: the run's profile takes F, B, sends and the optimizer from the CPU time
    (the wall time waited for a core), a receive's cost from its CPU time, and says so; a step without CPU times
    keeps the wall times."""
    from hetero.runtime.run.run_profile import run_profile, shared_core_stages

    plan = _three_stage_plan(monkeypatch, tiny_spec)
    assert plan.cluster.hosts[0].cores == 2 and shared_core_stages(plan) == {0, 1, 2}
    wall = {"F": 0.4, "B": 0.8, "SA": 0.01, "SG": 0.01, "RA": 0.3, "RG": 0.3, "STEP": 0.05, "clip_wait": 0.01}
    cpu = {"F": 0.2, "B": 0.5, "SA": 0.004, "SG": 0.004, "RA": 0.002, "RG": 0.006, "STEP": 0.02}
    lines = [step_line(step=s, stage_ops=[wall] * 3, stage_cpu_ops=[cpu] * 3) for s in range(1, 4)]
    prof = run_profile(plan, tmp_path, lines)
    assert prof is not None
    tokens = 4 * tiny_spec.seq_len
    for sp in plan.stages:
        dev = prof.device(sp.device)
        assert dev is not None
        kinds = [plan.graph.nodes[i].kind for i in range(sp.first_node, sp.last_node + 1)]
        fwd = sum(dev.layers[kind].fwd.at(tokens) for kind in kinds)
        assert fwd == pytest.approx(cpu["F"] / 4)  # per micro-batch, from the CPU time
        lora = sum(plan.graph.nodes[i].lora_params for i in range(sp.first_node, sp.last_node + 1))
        assert dev.optimizer is not None and dev.optimizer.at(lora) == pytest.approx(cpu["STEP"])
        receives = sum(1 for a in sp.actions() if a.op in ("RA", "RG"))
        if receives:
            assert dev.message_recv is not None
            assert dev.message_recv.at(dev.message_recv.samples[0][0]) == pytest.approx(
                sum(cpu[op] for op in ("RA", "RG") if any(a.op == op for a in sp.actions())) / receives)
            assert "CPU time" in dev.sources["message_recv"]
        assert "CPU time" in dev.sources["decoder"] and dev.cpu_time
        assert dev.measured_with == [s.device for s in plan.stages if s.device != sp.device]  # they ran beside it
    older = [step_line(step=s, stage_ops=[wall] * 3) for s in range(1, 4)]
    prof = run_profile(plan, tmp_path, older)
    assert prof is not None
    dev = prof.device(plan.stages[0].device)
    assert dev is not None
    assert "CPU time" not in dev.sources["decoder"] and not dev.cpu_time  # wall times (a plan shares no more)
    kinds = [plan.graph.nodes[i].kind for i in range(plan.stages[0].first_node, plan.stages[0].last_node + 1)]
    assert sum(dev.layers[kind].fwd.at(tokens) for kind in kinds) == pytest.approx(wall["F"] / 4)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("seed", range(4))
def test_with_cores_to_spare_the_global_clock_is_the_plain_simulation(schedule: str, seed: int) -> None:
    """planner/schedule/simshare.py with every stage at full speed reproduces planner/schedule/simulator.py exactly: step, events,
    busy and peak, with message overheads, slow links and the STEP round trip."""
    import random

    from hetero.planner.schedule.simshare import SharedSimulation
    from hetero.planner.schedule.simulator import _check_times

    rng = random.Random(seed)
    n, m = rng.randint(2, 4), rng.randint(1, 6)
    programs = programs_for(schedule, n, m)
    fwd, bwd = [rng.uniform(0.1, 1) for _ in range(n)], [rng.uniform(0.2, 2) for _ in range(n)]
    send = [rng.choice([0.0, rng.uniform(0, 1.5)]) for _ in range(n)]
    over = [{op: rng.uniform(0, 0.05) for op in ("RA", "SA", "RG", "SG", "STEP")} for _ in range(n)]
    sync = [rng.uniform(0, 0.1) for _ in range(n)]
    plain = simulate(programs, fwd, bwd, send, overhead_s=over, sync_s=sync)
    o, sy = _check_times(n, fwd, bwd, send, over, sync)
    roomy = SharedSimulation(programs, fwd, bwd, send, o, sy, CoreShare((0,) * n, (1,) * n, (n,))).run()
    assert roomy.step_time_s == pytest.approx(plain.step_time_s)
    key = lambda e: (e.stage, e.op, e.mb)  # noqa: E731
    for a, b in zip(sorted(plain.events, key=key), sorted(roomy.events, key=key), strict=True):
        assert key(a) == key(b) and a.start_s == pytest.approx(b.start_s) and a.end_s == pytest.approx(b.end_s)
    assert roomy.busy_fraction == pytest.approx(plain.busy_fraction)
    assert roomy.peak_in_flight == plain.peak_in_flight


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_programs_with_cores_to_spare_are_the_plain_simulation(seed: int) -> None:
    """The same for interleaved programs (planner/schedule/simulator.py's virtual stages, links per pair of devices): the
    global clock at full speed gives the plain simulation's step, events and peaks; with one core for the
    devices' two threads it is slower, never faster."""
    import random

    from hetero.planner.schedule.schedules import interleaved_one_f_one_b
    from hetero.planner.schedule.simshare import SharedSimulation
    from hetero.planner.schedule.simulator import _check_times

    rng = random.Random(seed)
    p, v = rng.randint(2, 3), rng.randint(2, 3)
    m = p * rng.randint(1, 3)
    programs = interleaved_one_f_one_b(p, m, v)
    fwd, bwd = [rng.uniform(0.1, 1) for _ in range(p * v)], [rng.uniform(0.2, 2) for _ in range(p * v)]
    send = [rng.choice([0.0, rng.uniform(0, 1.5)]) for _ in range(p * v)]
    over = [{op: rng.uniform(0, 0.05) for op in ("RA", "SA", "RG", "SG", "STEP")} for _ in range(p)]
    sync = [rng.uniform(0, 0.1) for _ in range(p)]
    plain = simulate(programs, fwd, bwd, send, overhead_s=over, sync_s=sync)
    o, sy = _check_times(p, fwd, bwd, send, over, sync, v)
    roomy = SharedSimulation(programs, fwd, bwd, send, o, sy, CoreShare((0,) * p, (1,) * p, (p,))).run()
    assert roomy.step_time_s == pytest.approx(plain.step_time_s)
    key = lambda e: (e.stage, e.op, e.mb, e.chunk)  # noqa: E731
    for a, b in zip(sorted(plain.events, key=key), sorted(roomy.events, key=key), strict=True):
        assert key(a) == key(b) and a.start_s == pytest.approx(b.start_s) and a.end_s == pytest.approx(b.end_s)
    assert roomy.peak_in_flight == plain.peak_in_flight
    tight = simulate(programs, fwd, bwd, send, overhead_s=over, sync_s=sync, cores=CoreShare((0,) * p, (1,) * p, (1,)))
    assert tight.step_time_s >= plain.step_time_s * (1 - 1e-9)


def test_a_run_measures_the_cores_its_shared_host_gave_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          tiny_spec: ModelSpec) -> None:
    """Steps slower than the replay of the stages' own work on 2 cores: the profile says how many cores they got
    (the capacity at which the replay takes as long as the steps), and a plan from that profile predicts those
    steps for the same split, citing the run; steps no slower than the replay leave all the cores."""
    from hetero.planner import plan as make_plan
    from hetero.planner.model.cost_model import RooflineCostModel
    from hetero.planner.model.profile_cost import ProfileCostModel
    from hetero.planner.schedule.simulator import replay_run
    from hetero.runtime.run.run_profile import own_ops, run_profile
    from hetero.specs import DataSpec, PlannerOptions, TrainSpec

    plan = _three_stage_plan(monkeypatch, tiny_spec)
    ops = {"F": 0.3, "B": 0.6, "SA": 0.004, "SG": 0.004, "RA": 0.2, "RG": 0.2, "STEP": 0.03, "clip_wait": 0.01}
    cpu = {"F": 0.2, "B": 0.4, "SA": 0.004, "SG": 0.004, "RA": 0.003, "RG": 0.003, "STEP": 0.02}
    base = [step_line(step=s, step_time_s=1.0, stage_ops=[ops] * 3, stage_cpu_ops=[cpu] * 3) for s in range(1, 5)]  # steps are numbered from 1
    timings = [own_ops(base[1:], k, 1) for k in range(3)]
    on_two = replay_run(plan, timings, decontended=True).step_time_s
    slow = [replace(line, step_time_s=on_two * 1.15) for line in base]
    prof = run_profile(plan, tmp_path, slow)
    assert prof is not None
    got = prof.host_cores["localhost"]
    assert 1.0 < got < 2.0
    assert replay_run(plan, timings, decontended=True, usable={"localhost": got}).step_time_s == pytest.approx(
        on_two * 1.15, rel=0.01)
    fast = run_profile(plan, tmp_path, [replace(line, step_time_s=on_two * 0.9) for line in base])
    assert fast is not None and fast.host_cores == {"localhost": 2.0}

    split = [sum(1 for i in range(s.first_node, s.last_node + 1) if plan.graph.nodes[i].kind == "decoder")
             for s in plan.stages]
    model = ProfileCostModel(prof, RooflineCostModel(), path=str(tmp_path))
    again = make_plan(tiny_spec, plan.graph, plan.cluster, TrainSpec(micro_batch_size=4, num_micro_batches=4),
                      DataSpec(), PlannerOptions(split=split, devices=[s.device for s in plan.stages]), model)
    assert again.cluster.hosts[0].usable_cores == got
    assert again.cost_sources["cores localhost"].startswith(f"run {tmp_path.resolve()}, step 4")
    assert again.prediction.step_time_s == pytest.approx(on_two * 1.15, rel=0.05)


def test_a_profile_timed_under_load_is_not_shared_again(monkeypatch: pytest.MonkeyPatch, tiny_spec: ModelSpec) -> None:
    """`hetero profile` times each of a host's CPU stages while the others run, so on 2 cores its times already
    include the waits for a core: a plan from it does not make the stages wait again (the same step as on a fleet
    that does not know the cores), and says why. A profile timed in CPU time, or without the others running, or
    one whose times did not all wait for a core, does."""
    from dataclasses import replace

    from fleets import synthetic_profile

    from hetero.compiler.trace import trace
    from hetero.planner import plan as make_plan
    from hetero.planner.model.cost_model import RooflineCostModel
    from hetero.planner.model.profile_cost import ProfileCostModel
    from hetero.specs import DataSpec, PlannerOptions, TrainSpec

    graph = trace(tiny_spec)
    short = _fleet([{"name": "localhost", "cores": 2, "devices": [{"type": "cpu", "threads": 1, "count": 3}]}])
    unknown = _fleet([{"name": "localhost", "devices": [{"type": "cpu", "threads": 1, "count": 3}]}])
    names = [d.name for d in short.devices]
    loaded = synthetic_profile(short, tiny_spec, dict.fromkeys(names, 2e-5))
    loaded = replace(loaded, devices=[replace(d, measured_with=[n for n in names if n != d.device],
                                              environment={**d.environment, "cpu_count": 2}) for d in loaded.devices])
    cpu_timed = replace(loaded, devices=[replace(d, cpu_time=True) for d in loaded.devices])
    train = TrainSpec(micro_batch_size=4, num_micro_batches=8)
    options = PlannerOptions(num_stages=3, time_limit_s=10, replicas=1, interleave="off")

    def planned(cluster, prof):
        return make_plan(tiny_spec, graph, cluster, train, DataSpec(), options,
                         ProfileCostModel(prof, RooflineCostModel(), path="profile.json"))

    again, plain, shared = planned(short, loaded), planned(unknown, loaded), planned(short, cpu_timed)
    assert again.cluster.hosts[0].cores is None
    assert "not shared again" in again.cost_sources["cores localhost"]
    assert again.prediction.step_time_s == pytest.approx(plain.prediction.step_time_s)
    assert shared.cluster.hosts[0].cores == 2 and "cores localhost" not in shared.cost_sources
    # A run's profile from before DeviceProfile.cpu_time said it in its sources only: read back, it is CPU time.
    older = to_dict(replace(loaded, devices=[replace(d, sources={"decoder": "run r, step 9" + SHARED_CORES_NOTE})
                                             for d in loaded.devices]))
    for device in older["devices"]:
        del device["cpu_time"]
    assert all(d.cpu_time for d in Profile.from_dict(older).devices)
    assert not any(d.cpu_time for d in Profile.from_dict(to_dict(loaded)).devices)
    alone = replace(loaded, devices=[replace(d, measured_with=[]) for d in loaded.devices])  # an older file
    assert planned(short, alone).cluster.hosts[0].cores == 2
    # The verdict says which way such a profile leans: its stages idle in the bubbles and wait less than profiled.
    leans = [v for v in again.verdict if "were profiled each while" in v]
    assert len(leans) == 1 and "(3 threads on 2 cores)" in leans[0] and "expect the step faster" in leans[0]
    computing = sum(again.prediction.stage_busy)  # one thread each, busy that share of the step
    assert f"in this plan {computing:.1f} threads compute at a time" in leans[0] and computing < 0.95 * 3
    assert any("were profiled each while" in v for v in plain.verdict)  # the fleet need not know the cores
    # Merged: two devices timed beside each other only (2 threads on 2 cores: no wait in their times) and a third
    # timed beside both: the first two never waited, so the cores are still shared.
    merged = replace(loaded, devices=[replace(d, measured_with=[n for n in names[:2] if n != d.device])
                                      if d.device in names[:2] else d for d in loaded.devices])
    assert planned(short, merged).cluster.hosts[0].cores == 2
    run = replace(loaded, devices=[replace(d, sources={"decoder": "run /r, step 9"}) for d in loaded.devices])
    unsaid = (shared, planned(short, alone), planned(short, merged), planned(unknown, run))
    assert not any("were profiled each while" in v for p in unsaid for v in p.verdict)  # CPU time; not beside
    # the others; not all waited; a run's own profile (timed at the pipeline's own duty cycle)


def test_an_interleaved_plans_what_if_shares_the_cores_as_its_prediction(tiny_spec: ModelSpec) -> None:
    """Two one-thread CPU devices on one core, interleaved: the what-if at the plan's own micro-batches re-simulates
    its programs with the cores shared as the planner did, so it gives the plan's prediction (it once ran them
    as if each device had a core of its own, and said the plan's own step faster than its prediction)."""
    from hetero.compiler.trace import trace
    from hetero.planner import plan as make_plan
    from hetero.planner.replan.whatif import more_micro_batches
    from hetero.specs import DataSpec, PlannerOptions, TrainSpec

    cluster = _fleet([{"name": "l", "cores": 1, "devices": [{"type": "cpu", "threads": 1, "count": 2}]}])
    planned = make_plan(tiny_spec, trace(tiny_spec), cluster, TrainSpec(micro_batch_size=4, num_micro_batches=4),
                        DataSpec(), PlannerOptions(split=[3, 3], interleave="always", time_limit_s=10))
    assert all(s.chunks for s in planned.stages)
    same = more_micro_batches(planned, (1,))[0]
    assert same.step_time_s == pytest.approx(planned.prediction.step_time_s, rel=1e-9)
