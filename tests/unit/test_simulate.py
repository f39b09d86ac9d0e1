"""`hetero simulate`: what-ifs, bottleneck verdicts, memory over time, and the run comparison."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fleets import a_plan, fleet
from metrics_rows import step_line

from hetero.planner import plan as make_plan
from hetero.planner.explain.bottleneck import diagnose, verdict
from hetero.planner.model.cost_model import RooflineCostModel
from hetero.planner.replan.whatif import (
    memory_over_time,
    more_micro_batches,
    other_schedules,
    what_ifs,
    without_device,
)
from hetero.planner.schedule.simulator import simulate_plan
from hetero.runtime.run.run_compare import compare_run
from hetero.specs import DataSpec, ModelSpec, PlannerOptions, TrainSpec


@pytest.fixture(scope="module")
def tiny_graph(tiny_spec: ModelSpec):
    from hetero.compiler.trace import trace

    return trace(tiny_spec)


def test_what_ifs_resimulate_and_replan(tiny_spec, tiny_graph) -> None:
    p = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=4, split=[3, 3])
    more = more_micro_batches(p, (2, 4))
    bubbles = [w.bubble_fraction for w in more]
    assert p.prediction.bubble_fraction > bubbles[0] > bubbles[1]  # more micro-batches: smaller bubble
    assert all(w.tokens_per_s > p.prediction.tokens_per_s for w in more)
    gpipe = other_schedules(p)[0]
    assert gpipe.name == "schedule=gpipe"
    # GPipe holds all 4 micro-batches on stage 0; 1F1B holds 2 there: more activation memory.
    assert gpipe.peak_memory_gb[0] > p.stages[0].memory.total_gb
    gone = without_device(p, p.stages[0].device)
    assert gone.feasible and "1 stage" in gone.description
    assert len(what_ifs(p)) == 1 + 2 + 2


def test_bottleneck_verdicts(tiny_spec, tiny_graph) -> None:
    uneven = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=2, split=[1, 5])
    kinds = [b.kind for b in diagnose(uneven)]
    assert "compute" in kinds
    compute = next(b for b in diagnose(uneven) if b.kind == "compute")
    assert compute.where == uneven.stages[1].device  # five layers on the second stage
    assert "bubble" in kinds and "more micro-batches" in " ".join(verdict(uneven))
    slow_link = a_plan(tiny_spec, tiny_graph, fleet([1, 1], link_gbps=0.0001), m=8, split=[3, 3])
    first = diagnose(slow_link)[0]
    assert first.kind in ("link", "bubble") and any(b.kind == "link" and b.where == "h0<->h1"
                                                    for b in diagnose(slow_link))
    full = replace(uneven.stages[0], memory=replace(uneven.stages[0].memory, total_gb=9.5, available_gb=10.0))
    tight = replace(uneven, stages=[full, uneven.stages[1]])
    assert diagnose(tight)[0].kind == "memory"
    # With many micro-batches the fill and drain is small: what idles is the fast stage waiting for the slow one,
    # and the advice is not "more micro-batches" (which would not recover it).
    lopsided = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=64, split=[1, 5])
    kinds = [b.kind for b in diagnose(lopsided)]
    assert "imbalance" in kinds and "bubble" not in kinds, verdict(lopsided)
    said = next(b for b in diagnose(lopsided) if b.kind == "imbalance")
    assert said.where == lopsided.stages[1].device and "more micro-batches recover only the 2%" in said.sentence


def test_memory_over_time_peaks_at_in_flight(tiny_spec, tiny_graph) -> None:
    p = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=8, split=[3, 3])
    timeline = simulate_plan(p)
    curves = memory_over_time(p, timeline)
    for k, sp in enumerate(p.stages):
        peak = max(gb for _, gb in curves[k])
        assert peak == pytest.approx(sp.memory.total_gb, rel=1e-6)  # the planner's peak is what the timeline reaches
        assert curves[k][-1][1] == pytest.approx(sp.memory.total_gb - sp.memory.activations_gb, abs=1e-9)


def test_compare_run_flags_a_stage_off_by_more_than_20_percent(tiny_spec, tiny_graph) -> None:
    p = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=8, split=[3, 3])
    m = p.train.num_micro_batches
    ops = []
    for k, sp in enumerate(p.stages):
        factor = 1.05 if k == 0 else 1.6  # stage 1 is 60% slower than predicted
        ops.append({"F": factor * m * sp.fwd_time_s, "B": factor * m * sp.bwd_time_s, "RA": 0.0, "RG": 0.0})
    step = p.prediction.step_time_s * 1.4
    lines = compare_run(p, [step_line(step=n, step_time_s=step, stage_ops=ops) for n in range(1, 4)])
    assert "more than 20% off" in lines[0]  # the step is 40% off
    assert "hetero profile model=" in lines[1]  # a datasheet plan: the fix is to measure
    assert "more than 20% off" not in lines[2] and "more than 20% off" in lines[3]
    assert "+60%" in lines[3]
    assert any(line.startswith("Measured:") for line in lines)


def test_simulate_cli_prints_and_draws(tiny_spec, tiny_graph, tmp_path: Path, capsys) -> None:
    from hetero.cli import main

    p = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=4, split=[3, 3])
    path = tmp_path / "plan.json"
    p.save(path)
    assert main(["simulate", str(path), "--no-replan"]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "utilization" in out and "schedule=gpipe" in out and "num_micro_batches=8" in out
    assert (tmp_path / "simulate.png").stat().st_size > 1000
    assert main(["simulate", str(tmp_path / "nope.json")]) == 2


def _ops_like_plan(p, factors: list[float]) -> list[dict[str, float]]:
    """Per-stage op seconds of one step, as the runtime reports them, with compute scaled by ``factors``."""
    m = p.train.num_micro_batches
    return [{"F": f * m * sp.fwd_time_s, "B": f * m * sp.bwd_time_s, "SA": m * sp.overhead_s.get("SA", 0.0),
             "SG": m * sp.overhead_s.get("SG", 0.0), "STEP": sp.overhead_s.get("STEP", 0.0) + 0.5, "clip_wait": 0.5,
             "RA": 3.0, "RG": 3.0}  # waits say nothing about the work: the replay ignores them
            for sp, f in zip(p.stages, factors, strict=True)]


def test_replay_with_the_plans_own_times_is_the_prediction(tiny_spec, tiny_graph) -> None:
    from hetero.planner.schedule.simulator import ScheduleError, replay_run

    p = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=8, split=[3, 3])
    assert replay_run(p, _ops_like_plan(p, [1.0, 1.0])).step_time_s == pytest.approx(p.prediction.step_time_s)
    slow = replay_run(p, _ops_like_plan(p, [1.0, 1.5])).step_time_s
    assert slow > 1.3 * p.prediction.step_time_s  # the bottleneck stage 50% slower
    with pytest.raises(ScheduleError, match="timings for 1 stages"):
        replay_run(p, _ops_like_plan(p, [1.0, 1.0])[:1])


def test_simulate_compares_a_finished_run(tiny_spec, tiny_graph, tmp_path: Path, capsys) -> None:
    """`hetero simulate plan.json --run DIR`: prediction vs measurement vs the run's own times replayed."""
    import json

    from hetero.cli import main
    from hetero.planner.schedule.simulator import replay_run

    p = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=8, split=[3, 3])
    p.save(tmp_path / "plan.json")
    run = tmp_path / "run"
    run.mkdir()
    p.save(run / "plan.json")
    ops = _ops_like_plan(p, [1.3, 1.3])  # every stage computes 30% slower than profiled
    replayed = replay_run(p, ops).step_time_s
    step = replayed * 1.02
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "loss": 2.0, "step_time_s": step, "stage_ops": ops})
                                               + "\n" for n in range(1, 5)))
    assert main(["simulate", str(tmp_path / "plan.json"), "--no-replan", "--run", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"measured/replayed {step / replayed:.2f}" in out
    assert "schedule model holds" in out and "Re-profile" in out
    other = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=8, split=[2, 4])
    other.save(run / "plan.json")
    assert main(["simulate", str(tmp_path / "plan.json"), "--no-replan", "--run", str(run)]) == 2
    assert "ran another plan" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "plan.json"), "--no-replan", "--run", str(tmp_path / "none")]) == 2


def test_memory_over_time_counts_in_flight_per_replica(tiny_spec, tiny_graph) -> None:
    """Two replicas of two stages, 8 micro-batches shared: each stage's curve peaks at the planner's peak,
    counted over its own pipeline and share (not the whole plan's four stages and eight micro-batches)."""
    train = TrainSpec(micro_batch_size=4, num_micro_batches=8)
    p = make_plan(tiny_spec, tiny_graph, fleet([1, 1, 1, 1]), train, DataSpec(),
                  PlannerOptions(time_limit_s=5, replicas=2, num_stages=2))
    assert len(p.replicas) == 2 and all(len(r.stages) == 2 for r in p.replicas)
    timeline = simulate_plan(p)
    curves = memory_over_time(p, timeline)
    for k, sp in enumerate(p.stages):
        assert max(gb for _, gb in curves[k]) == pytest.approx(sp.memory.total_gb, rel=1e-6), k


def test_a_cpu_stage_of_tiny_layers_is_said_to_be_bound_by_its_operators(tiny_spec, tiny_graph) -> None:
    """The README demo's datasheet plan predicted 0.077 s for a step measured at 0.31 s: calling a tiny layer's ~300
    operators on a CPU costs more than its arithmetic (planner/explain/caveats.py). The verdict says so before the run
    does, with the factor; a profiled plan measures it and says nothing."""
    from hetero.planner.explain.caveats import CPU_CALLS_S, issue_bound_lines
    from hetero.planner.model.profile_cost import ProfileCostModel

    p = a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=4, split=[3, 3])
    lines = [v for v in p.verdict if "operators one after another" in v]
    per_layer = [s.compute_s() / 3 for s in p.stages]  # 3 decoder layers each (and the head on stage 1)
    factors = [(t + CPU_CALLS_S) / t for t in per_layer]
    under = [k for k, f in enumerate(factors) if f >= 2]
    assert under and [line.split(":")[0] for line in lines] == [f"Stage {k} ({p.stages[k].device})" for k in under]
    assert f"expect this stage {factors[under[0]]:.0f}x slower than predicted or more on such a CPU" in lines[0]
    assert 2 <= factors[0] < 3  # the demo's stages: measured 3.7x (docs/profiling.md)
    slow = [replace(s, fwd_time_s=s.fwd_time_s * 20, bwd_time_s=s.bwd_time_s * 20) for s in p.stages]
    assert issue_bound_lines(slow, RooflineCostModel()) == []  # layers priced above the calls: no line
    free = [replace(s, fwd_time_s=0.0, bwd_time_s=0.0) for s in p.stages]  # a made-up device (tests' fleets)
    assert issue_bound_lines(free, RooflineCostModel()) == []  # nothing to compare with (it divided by zero)
    assert issue_bound_lines(p.stages, ProfileCostModel.__new__(ProfileCostModel)) == []
