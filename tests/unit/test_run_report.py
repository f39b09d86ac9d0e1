"""The end-of-run report, steps.png and `hetero simulate --run` on a run that rebalanced; device telemetry.

A synthetic metrics.jsonl (no real run): stage 0 slows 3x after step 2, a move after step 5 shifts
layers to stage 1, and the steps after it run on the new split. Each split is judged against its own
prediction, the move's gain is measured around it (its own step left out), and every reader of
metrics.jsonl skips the event line. Telemetry parsing runs against a fake NVML module.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fleets import a_plan, fleet
from metrics_rows import records

from hetero.protocol import StepDone
from hetero.runtime.run.metrics_file import RunLines, read_metrics
from hetero.runtime.run.records import metrics_line
from hetero.runtime.run.report import build_report, print_report, write_report
from hetero.runtime.run.run_compare import compare_run, median_step_s, stage_timings_from_metrics
from hetero.runtime.run.steps_picture import draw_steps, steps_picture_data
from hetero.runtime.stage import telemetry as tm


@pytest.fixture(scope="module")
def tiny_graph(tiny_spec):
    from hetero.compiler.trace import trace

    return trace(tiny_spec)


@pytest.fixture(scope="module")
def plan(tiny_spec, tiny_graph):
    return a_plan(tiny_spec, tiny_graph, fleet([1, 1]), m=8, split=[3, 3])


def _line(step: int, step_s: float, compute: list[float], split: list[int], telemetry: Any = None) -> dict[str, Any]:
    """A metrics.jsonl step line with the given per-stage forward + backward seconds."""
    return {"step": step, "loss": 2.0 - 0.01 * step, "lr": 1e-4, "tokens": 512, "step_time_s": step_s,
            "stage_busy": [c + 0.01 for c in compute],
            "stage_ops": [{"F": 0.4 * c, "B": 0.6 * c, "STEP": 0.01, "RA": 0.0, "RG": 0.0, "SA": 0.0, "SG": 0.0}
                          for c in compute],
            "split": split, "stage_telemetry": telemetry or [None, None]}


def _run(plan) -> tuple[list[dict[str, Any]], dict[str, Any], float, list[float]]:
    """Steps 0-5 on 3/3 (stage 0 3x slower from step 3), a move after step 5, steps 6-11 on 1/5."""
    P = plan.prediction.step_time_s
    c = [plan.micro_batches_of(k) * (sp.fwd_time_s + sp.bwd_time_s) for k, sp in enumerate(plan.stages)]
    after = [1.0 * c[0], 1.6 * c[1]]  # the move's prediction for the new split
    steps = [_line(0, 5 * P, c, [3, 3]), _line(1, P, c, [3, 3]), _line(2, P, c, [3, 3])]
    steps += [_line(n, 3 * P, [3 * c[0], c[1]], [3, 3]) for n in (3, 4, 5)]
    # Step 6 holds the move itself; stage 1 then computes 50% more than the move predicted, stage 0 5%.
    for n, f in zip(range(6, 12), (100.0, 1.4, 1.5, 1.6, 1.5, 1.7), strict=True):
        steps.append(_line(n, f * P, [1.05 * after[0], 1.5 * after[1]], [1, 5]))
    event = {"event": "rebalance", "after_step": 5,
             "cause": {"stage": 0, "device": plan.stages[0].device, "slowdown": 3.0, "reason": "stage 0 3x slower"},
             "old_split": [3, 3], "new_split": [1, 5], "old_spans": [[0, 3], [4, 7]], "new_spans": [[0, 1], [2, 7]],
             "predicted_step_s_before": 3 * P, "predicted_step_s_after": 1.5 * P, "predicted_gain": 2.0,
             "move_s": 0.8, "predicted_stage_s_after": after}
    return steps, event, P, c


def test_report_judges_each_split_by_its_own_prediction_and_measures_the_move(plan) -> None:
    steps, event, P, c = _run(plan)
    report = build_report(plan, records(steps), {0: 1.0, 1: 1.2}, "run", records([event]))  # type: ignore[arg-type]
    assert report["steps"] == 12
    first, second = report["segments"]
    # Before the move: the plan's prediction; steps 1-5 measure it (step 0 warms up): median of P,P,3P,3P,3P.
    assert (first["first_step"], first["last_step"], first["split"]) == (0, 5, [3, 3])
    assert first["predicted_step_s"] == pytest.approx(P) and first["measured_step_s"] == pytest.approx(3 * P)
    assert [s["predicted_compute_s"] for s in first["stages"]] == pytest.approx(c)
    assert report["measured_step_time_s"] == pytest.approx(3 * P)  # the top line is the plan's split
    # After it: the move's prediction; step 6 (the move's own) is left out.
    assert (second["first_step"], second["last_step"], second["split"]) == (6, 11, [1, 5])
    assert second["predicted_step_s"] == pytest.approx(1.5 * P)
    assert second["measured_step_s"] == pytest.approx(1.5 * P)  # median of 1.4 1.5 1.6 1.5 1.7
    assert [s["measured_compute_s"] for s in second["stages"]] == pytest.approx(
        [1.05 * event["predicted_stage_s_after"][0], 1.5 * event["predicted_stage_s_after"][1]])
    # The move: 4 steps either side, its own left out: median(P, 3P, 3P, 3P) / median(1.4, 1.5, 1.6, 1.5) P.
    (move,) = report["moves"]
    assert move["measured_gain"] == pytest.approx(2.0)
    assert (move["steps_before"], move["steps_after"]) == ([2, 5], [7, 10])
    assert (move["old_split"], move["new_split"], move["predicted_gain"]) == ([3, 3], [1, 5], 2.0)
    assert move["device"] == plan.stages[0].device and move["slowdown"] == 3.0
    # The comparison flags stage 1 after the move (50% over the move's prediction), not stage 0 (5%).
    after = [line for line in report["comparison"] if line.startswith("  stage")]
    assert "+5%" in after[0] and "more than 20% off" not in after[0]
    assert "+50%" in after[1] and "more than 20% off" in after[1]
    # A device changed speed: re-profiling the fleet is not the advice (a run without moves gets it).
    assert not any("come from datasheets" in line for line in report["comparison"])
    # Events among the step lines (as metrics.jsonl holds them) give the same report.
    mixed = build_report(plan, records(steps[:6] + [event] + steps[6:]), {0: 1.0, 1: 1.2}, "run")
    assert mixed["moves"] == report["moves"] and mixed["segments"] == report["segments"]


def test_a_run_without_moves_reports_as_before(plan) -> None:
    steps, _, P, c = _run(plan)
    report = build_report(plan, records(steps[:6]), {}, "run")
    assert report["moves"] == [] and len(report["segments"]) == 1
    assert compare_run(plan, records(steps[:6])) == report["comparison"]
    assert any("come from datasheets" in line for line in report["comparison"])  # 3x off, datasheet costs
    # The plan's busy prediction counts what busy_s measures: compute and the optimizer.
    ov = [sp.overhead_s.get("STEP", 0.0) for sp in plan.stages]
    assert [s["predicted_busy_s"] for s in report["stages"]] == pytest.approx([a + b for a, b in zip(c, ov, strict=True)])


def test_steps_picture_marks_the_move_and_each_splits_prediction(plan, tmp_path: Path) -> None:
    steps, event, P, _ = _run(plan)
    gpu = {"source": "nvml", "sm_clock_mhz": 1500.0, "temperature_c": 80.0, "throttle": []}
    steps = [{**s, "stage_telemetry": [gpu, None]} for s in steps]
    data = steps_picture_data(plan, records([*steps, event]))
    assert data.steps == list(range(12))
    assert [(a, b) for a, b, _ in data.predicted] == [(-0.5, 5.5), (5.5, 11.5)]
    assert [y for _, _, y in data.predicted] == pytest.approx([P, 1.5 * P])
    ((x, label),) = data.moves
    assert x == 5.5 and "3/3 -> 1/5" in label and "predicted 2.00x" in label and "measured 2.00x" in label
    assert len(data.stage_busy_s) == 2
    # The steady steps set the scale; the warm-up and the move's own step are marked above it with their times.
    assert data.clipped == [(0, pytest.approx(5 * P)), (6, pytest.approx(100 * P))]
    assert [k for k, *_ in data.clocks] == [0]  # only the stage that reports telemetry; the CPU has none
    path = draw_steps(plan, records([*steps, event]), tmp_path / "steps.png")
    assert path.stat().st_size > 5000
    # A hand-edited plan's 2 MB model name is cut in the title (drawing it whole failed after training).
    named = replace(plan, model=replace(plan.model, name="m" * 2_000_000))
    title = steps_picture_data(named, records([*steps, event])).title
    assert title.startswith("m" * 59 + "…") and len(title) < 150
    assert draw_steps(named, records([*steps, event]), tmp_path / "named.png").stat().st_size > 5000


def test_every_reader_skips_event_lines(plan, tmp_path: Path, capsys) -> None:
    from hetero.cli import main

    steps, event, _, _ = _run(plan)
    evaluation = {"step": 5, "eval_loss": 1.9, "eval_tokens": 64, "eval_s": 0.1}
    lines = steps[:6] + [evaluation, event] + steps[6:]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    plan.save(run / "plan.json")
    plan.save(tmp_path / "plan.json")
    read = read_metrics(run / "metrics.jsonl")
    assert read.steps == RunLines(records(steps)).steps and read.moves == records([event])
    assert [type(x).__name__ for x in read.lines] == ["StepLine"] * 6 + ["EvalLine", "RebalanceEvent"] + ["StepLine"] * 6
    assert median_step_s(read.steps) == median_step_s(RunLines(records(steps)).steps)
    assert stage_timings_from_metrics(read.steps) == stage_timings_from_metrics(RunLines(records(steps)).steps)
    assert main(["simulate", str(tmp_path / "plan.json"), "--no-replan", "--run", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "after step 5:" in out and "split 3/3 -> 1/5" in out and "on split 1/5:" in out
    assert (run / "steps.png").is_file()
    report = write_report(plan, records(steps + [evaluation]), {}, run, records([event]))  # type: ignore[arg-type]
    assert json.loads((run / "report.json").read_text())["moves"] == json.loads(json.dumps(report["moves"]))
    print_report(report)
    printed = " ".join(capsys.readouterr().out.split())
    assert "moves" in printed and "gain predicted 2.00x, measured 2.00x" in printed and "steps.png" in printed
    # loss.png beside it, from every line of metrics.jsonl (the evaluation's too), named in the report.
    assert report["loss_picture"] == str(run / "loss.png") and (run / "loss.png").stat().st_size > 5000
    assert f"loss over the run: {run / 'loss.png'}" in printed
    assert "run " + str(run) + ": 12 steps, loss 2.000 -> 1.890" in printed  # this plan trained them all


def test_the_headline_of_a_resumed_or_re_planned_run_counts_the_whole_run(plan, tmp_path: Path, capsys) -> None:
    """After `--resume` or a re-plan (runtime.elastic), this plan trained the last steps only: the headline says the
    run's steps and its first loss from metrics.jsonl (stop 48's CI run read "33 steps, loss 6.033" for 40 from
    6.213), and how many steps this plan trained."""
    steps, _, _, _ = _run(plan)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    report = write_report(plan, records(steps[7:]), {}, tmp_path)  # type: ignore[arg-type]
    assert (report["steps"], report["run_steps"], report["run_first_loss"]) == (5, 12, 2.0)
    print_report(report)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"run {tmp_path}: 12 steps (the last 5 on this plan), loss 2.000 -> 1.890" in printed


def test_loss_picture_draws_each_step_once_its_mean_the_evaluations_and_the_recoveries() -> None:
    from hetero.runtime.run.loss_picture import loss_picture_data

    def step(n: int, loss: float) -> dict:
        return {"step": n, "loss": loss, "step_time_s": 0.1}

    lines = [step(n, 4.0 - 0.1 * n) for n in range(12)]
    lines += [{"step": 9, "eval_loss": 3.5}, step(10, 3.0), step(11, float("nan")), step(12, 2.8)]  # 10, 11 again
    recovery = {"event": "recovery", "after_step": 11, "device": "box.gpu1", "recovery": 1, "host": "box",
                "cause": "exited", "resumed_from_step": 10, "replayed_steps": 2, "old_split": [3, 3],
                "new_split": [6], "devices": ["box.gpu0"], "plan": "plan-recovery-1.json"}
    move = {"event": "rebalance", "after_step": 4, "cause": {"reason": "forced by the caller"}, "old_split": [3, 3],
            "new_split": [2, 4], "old_spans": [[0, 3], [4, 7]], "new_spans": [[0, 2], [3, 7]]}
    data = loss_picture_data(records([*lines, recovery, move]), "tiny")
    assert data.steps == [*range(11), 12]  # step 10 once (its last line), step 11's NaN left out
    assert data.loss[10] == 3.0 and data.window == 2 and data.mean[1] == pytest.approx((4.0 + 3.9) / 2)
    assert (data.eval_steps, data.eval_loss) == ([9], [3.5])
    assert data.events == [(11.5, "lost box.gpu1")]  # recoveries only: moves are steps.png's


# -- telemetry ---------------------------------------------------------------------------------------------


class NotSupported(Exception):
    pass


def fake_nvml(mask: int = 0x20 | 0x4, power_mw: int | None = 250_000, old: bool = False) -> types.ModuleType:
    """A pynvml stand-in for one GPU: SM at 1100 of 1980 MHz, 87 C, ``power_mw`` of a 250 W limit."""
    nvml = types.ModuleType("pynvml")
    nvml.asked = []  # type: ignore[attr-defined]

    def handle(index: int) -> str:
        nvml.asked.append(index)  # type: ignore[attr-defined]
        return f"gpu{index}"

    def power(h: str) -> int:
        if power_mw is None:
            raise NotSupported("power")
        return power_mw

    def by_uuid(uuid: str) -> str:
        raise NotSupported(uuid)

    reasons = "nvmlDeviceGetCurrentClocksThrottleReasons" if old else "nvmlDeviceGetCurrentClocksEventReasons"
    for name, fn in {
        "nvmlInit": lambda: None, "nvmlDeviceGetHandleByIndex": handle, "nvmlDeviceGetHandleByUUID": by_uuid,
        "nvmlDeviceGetClockInfo": lambda h, kind: 1100 if kind == tm.NVML_CLOCK_SM else 0,
        "nvmlDeviceGetMaxClockInfo": lambda h, kind: 1980 if kind == tm.NVML_CLOCK_SM else 0,
        "nvmlDeviceGetTemperature": lambda h, sensor: 87, "nvmlDeviceGetPowerUsage": power,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 250_000, reasons: lambda h: mask,
    }.items():
        setattr(nvml, name, fn)
    return nvml


def test_nvml_telemetry_reads_clocks_temperature_power_and_throttle_reasons(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    t = tm.open_telemetry(SimpleNamespace(type="cuda", index=0))
    assert isinstance(t, tm.NvmlTelemetry)
    reading = tm.sample(t)
    assert reading == {"source": "nvml", "sm_clock_mhz": 1100.0, "max_sm_clock_mhz": 1980.0, "temperature_c": 87.0,
                       "power_w": 250.0, "power_limit_w": 250.0, "throttle": ["sw_power_cap", "sw_thermal_slowdown"]}
    assert tm.throttle_cause(reading) == "thermal slowdown at 87 C, SM clock 1100 MHz of 1980"
    # An older pynvml (throttle reasons), a sensor the card lacks: the rest still reads.
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(mask=0x4, power_mw=None, old=True))
    reading = tm.sample(tm.open_telemetry(SimpleNamespace(type="cuda", index=0)))
    assert reading is not None and reading["power_w"] is None and reading["throttle"] == ["sw_power_cap"]
    assert tm.throttle_cause(reading) == "power cap, SM clock 1100 MHz of 1980"
    assert tm.throttle_cause({**reading, "power_w": 249.6}) == "power cap (250 W of 250 W), SM clock 1100 MHz of 1980"


def test_no_telemetry_where_there_is_none(monkeypatch) -> None:
    assert tm.open_telemetry(SimpleNamespace(type="cpu", index=None)) is None  # nothing invented for a CPU
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: `import pynvml` fails
    assert tm.open_telemetry(SimpleNamespace(type="cuda", index=0)) is None
    assert tm.sample(None) is None
    for mask in (0x0, 0x1, 0x10, 0x100, 0x2):  # idle, sync boost, display clocks, app clocks at full speed
        reading = {"throttle": tm.nvml_reasons(mask), "sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980}
        assert tm.throttle_cause(reading) is None, mask
    held = {"throttle": ["applications_clocks_setting"], "sm_clock_mhz": 900, "max_sm_clock_mhz": 1980}
    assert "application clocks" in tm.throttle_cause(held)  # type: ignore[operator]
    assert tm.throttle_cause({"throttle": ["hw_slowdown"], "temperature_c": 91}).startswith(  # type: ignore[union-attr]
        "hardware slowdown (heat or power) at 91 C")
    assert tm.throttle_cause(None) is None


def test_telemetry_travels_in_stepdone_and_lands_in_metrics_cleaned(plan) -> None:
    from hetero.runtime.stage.executor import StepStats

    reading = {"source": "nvml", "sm_clock_mhz": 1100.0, "temperature_c": 87.0, "throttle": ["sw_thermal_slowdown"]}
    stats = StepStats(step=3, loss_sum=None, num_label_tokens=None, grad_sumsq=1.0, lr=1e-4, busy_s=0.5, wall_s=0.6,
                      op_time_s={"F": 0.2}, telemetry=reading)
    assert StepDone.from_wire(stats.to_meta()).telemetry == reading
    cpu = StepStats(step=3, loss_sum=2.0, num_label_tokens=10, grad_sumsq=1.0, lr=1e-4, busy_s=0.5, wall_s=0.6)
    assert "telemetry" not in cpu.to_meta() and StepDone.from_wire(cpu.to_meta()).telemetry is None
    # What a peer sent is cleaned before it goes into metrics.jsonl: unknown keys, NaN and odd reasons dropped.
    sent = {**reading, "sm_clock_mhz": float("nan"), "evil": "x" * 100, "throttle": ["sw_thermal_slowdown", "rm -rf"]}
    meta = {**stats.to_meta(), "telemetry": sent}
    done = {0: SimpleNamespace(meta=meta), 1: SimpleNamespace(meta={**cpu.to_meta(), "loss_sum": 20.0})}
    line = metrics_line(plan, 3, done, 1.0, 1.0, 10, 0.7)
    assert line.stage_telemetry == [{"source": "nvml", "sm_clock_mhz": None, "temperature_c": 87.0,
                                        "throttle": ["sw_thermal_slowdown"]}, None]
    assert tm.clean_telemetry({"source": "nvml"}) is None and tm.clean_telemetry("hot") is None
    from hetero.runtime.run.report import telemetry_lines

    cooler = replace(line, stage_telemetry=[{"temperature_c": 70.0, "throttle": []}, None])
    summary = tm.telemetry_summary([line, cooler], 2)
    assert summary[1] is None
    assert summary[0] == {"samples": 2, "min_sm_clock_mhz": None, "max_temperature_c": 87.0, "max_power_w": None,
                          "throttled_steps": 1, "throttle": ["thermal slowdown"]}
    assert telemetry_lines(summary) == ["device telemetry, stage 0: hottest 87 C, throttled in 1 of 2 steps "
                                        "(thermal slowdown)"]


def test_a_metrics_line_still_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    """A live run appends metrics.jsonl while tools and tests read it: a last line cut mid-write is skipped (CI met
    it as a JSONDecodeError), a whole one without its newline is kept."""
    from hetero.runtime.run.metrics_file import read_rows

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2, "loss": 6.1, "stage_ops": [{"F": 0.02,')
    assert read_rows(path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2}')
    assert read_rows(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1, "loss": 2.0, "step_time_s": 0.5}\n{"step": 2, "loss": 1.9, "step_time_s": 0.')
    assert [s.step for s in read_metrics(path).steps] == [1]


def test_a_run_dir_of_steps_numbered_from_0_is_renumbered_when_resumed() -> None:
    """metrics.jsonl numbered its steps from 0 before issue 53 made them count from 1: resuming such a run dir after
    2 steps keeps its steps 1-2 (were 0-1), its events and evaluations on the same numbers, not step 3 twice."""
    from hetero.runtime.run.metrics_file import kept_lines

    old = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.9}, {"step": 1, "eval_loss": 2.5},
           {"event": "rebalance", "after_step": 1}, {"step": 2, "loss": 2.8}, {"step": 3, "loss": 2.7}]
    kept = [json.loads(line) for line in kept_lines("".join(json.dumps(r) + "\n" for r in old), 2, False)]
    assert kept == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}, {"step": 2, "eval_loss": 2.5},
                    {"event": "rebalance", "after_step": 2}]
    new = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}, {"step": 3, "loss": 2.8}]
    assert [json.loads(line) for line in kept_lines("".join(json.dumps(r) + "\n" for r in new), 2, False)] == new[:2]
