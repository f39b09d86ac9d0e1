"""Throughput in trained tokens: metrics.jsonl's tokens_per_s counts label tokens (the computed count beside it),
the progress bar says trained tok/s, and the report compares trained tokens/s with the plan's prediction; on
both engines, and on metrics lines written before trained tokens were counted."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
from fleets import a_plan, fleet
from metrics_rows import records

from hetero.plan import Plan, with_label_fraction
from hetero.runtime.run.metrics_file import to_json
from hetero.runtime.run.records import ProgressBar, metrics_line, throughput
from hetero.runtime.run.report import build_report, tokens_line

COMPUTED = 8 * 4 * 128  # num_micro_batches x micro_batch_size x seq_len of a_plan's tiny plan


@pytest.fixture(scope="module")
def plan(tiny_spec) -> Plan:
    from hetero.compiler.trace import trace

    return a_plan(tiny_spec, trace(tiny_spec), fleet([1, 1]), m=8, split=[3, 3])


def _done(plan: Plan, loss_sum: float, label_tokens: int) -> dict[int, Any]:
    """Every stage's stepdone for one step: the last holds the loss over ``label_tokens``."""
    meta = {"step": 4, "loss_sum": None, "num_label_tokens": None, "grad_sumsq": 1.0, "lr": 1e-4, "busy_s": 0.4,
            "wall_s": 0.5, "op_time_s": {"F": 0.2, "B": 0.2}}
    last = {**meta, "loss_sum": loss_sum, "num_label_tokens": label_tokens}
    return {k: SimpleNamespace(meta=last if k == len(plan.stages) - 1 else meta) for k in range(len(plan.stages))}


def test_metrics_lines_count_label_tokens(plan: Plan) -> None:
    line = json.loads(to_json(metrics_line(plan, 4, _done(plan, 600.0, 300), 1.0, 1.0, 300, 0.5)))  # as written
    assert line["loss"] == 2.0 and line["format"] == 1
    assert line["label_tokens"] == 300 and line["tokens_per_s"] == 600.0  # trained: 300 label tokens in 0.5 s
    assert line["computed_tokens"] == COMPUTED and line["computed_tokens_per_s"] == COMPUTED / 0.5
    assert "tokens" not in line and "record_tokens" not in line
    # The step's tokens that are not padding, where the coordinator passes them (StepBatch.num_tokens).
    line = json.loads(to_json(metrics_line(plan, 4, _done(plan, 600.0, 300), 1.0, 1.0, 300, 0.5, record_tokens=3000)))
    assert line["record_tokens"] == 3000


def test_the_torch_engine_writes_the_same_counts(plan: Plan) -> None:
    pytest.importorskip("torch.distributed.pipelining")
    from hetero.runtime.torch_engine.rank import metrics

    line = json.loads(to_json(metrics(plan, 2, (600.0, 1e-4, 1.0, 1.0, [{"F": 0.1}, {"F": 0.1}]), 300, 0.5)))
    assert {k: line[k] for k in throughput(plan, 300, 0.5)} == throughput(plan, 300, 0.5)
    assert line["tokens_per_s"] == 600.0 and line["engine"] == "torch"


def test_the_progress_bar_shows_trained_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    with ProgressBar(3, True) as bar:
        assert any("trained tok/s" in str(getattr(c, "text_format", "")) for c in bar.bar.columns)
        bar.update(0, 2.0, 1234.0)
        assert bar.bar.tasks[0].fields["tps"] == "1,234"


def test_a_resumed_runs_eta_counts_only_its_own_steps() -> None:
    """Resumed at step 95 of 100, one step in 2 s: 4 steps are left, 8 s (it said elapsed 0:00:02 ETA 0:00:00, the
    96 steps of both runs sharing this run's 2 s; issue 53)."""
    from hetero.runtime.run.records import plain_progress

    line = plain_progress(95, 100, 1.5, 100.0, elapsed_s=2.0, first=95)
    assert line.startswith("step 96/100 (96%)") and line.endswith("elapsed 0:00:02  ETA 0:00:08"), line
    assert plain_progress(9, 100, 1.5, 100.0, elapsed_s=10.0).endswith("ETA 0:01:30")  # a fresh run: as before


def test_off_a_terminal_progress_is_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """`hetero run ... | tee log`: a line after the first step, then at most one per interval, and after the last;
    nothing with --no-progress."""
    with ProgressBar(200, True, every_s=3600) as bar:
        for step in range(200):
            bar.update(step, 2.0 - step / 200, 1234.5)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 1/200 (0%)  loss 2.0000  1,234 trained tok/s  elapsed 0:00:00  ETA ")
    assert lines[1].startswith("step 200/200 (100%)  loss 1.0050  1,234 trained tok/s  elapsed ")
    assert lines[1].endswith("ETA 0:00:00")
    with ProgressBar(5, True, every_s=0) as bar:
        for step in range(5):
            bar.update(step, 1.0, 10.0)
    assert len(capsys.readouterr().out.splitlines()) == 5
    with ProgressBar(5, False, every_s=0) as bar:
        bar.update(0, 1.0, 10.0)
    assert capsys.readouterr().out == ""


def _lines(plan: Plan, labels: list[int], step_s: float, old: bool = False) -> list[dict[str, Any]]:
    out = []
    for step, n in enumerate(labels):
        line = {"step": step, "loss": 2.0, "lr": 1e-4, "step_time_s": step_s, "label_tokens": n,
                "stage_busy": [0.1, 0.1], "stage_ops": [{"F": 0.04, "B": 0.06}, {"F": 0.04, "B": 0.06}],
                "split": [3, 3]}
        # Before trained tokens were counted, "tokens" was the computed count and tokens_per_s its rate.
        line.update({"tokens": COMPUTED, "tokens_per_s": COMPUTED / step_s} if old else throughput(plan, n, step_s))
        out.append(line)
    return out


def test_the_report_says_trained_tokens_per_second(plan: Plan) -> None:
    step_s = plan.prediction.step_time_s
    labels = [900, 1000, 1100, 1000]
    # The plan was compiled without data statistics: trained tokens/s measured, but not predicted.
    report = build_report(plan, records(_lines(plan, labels, step_s)), {}, "run")
    assert report["label_tokens_per_step"] == 1000 and report["computed_tokens_per_step"] == COMPUTED
    assert report["measured_tokens_per_s"] == pytest.approx(1000 / step_s)
    assert report["measured_computed_tokens_per_s"] == pytest.approx(COMPUTED / step_s)
    assert report["predicted_tokens_per_s"] is None
    assert report["predicted_computed_tokens_per_s"] == plan.prediction.tokens_per_s
    line = tokens_line(report)
    assert line.startswith(f"trained tokens/s: measured {1000 / step_s:,.0f} (not predicted: the data was not measured")
    assert f"computed tokens/s, padding included: measured {COMPUTED / step_s:,.0f}" in line
    # With data statistics the plan predicts them: label_fraction x its computed tokens/s.
    measured = dataclasses.replace(plan, prediction=with_label_fraction(plan.prediction, 0.25))
    report = build_report(measured, records(_lines(plan, labels, step_s)), {}, "run")
    assert report["predicted_tokens_per_s"] == pytest.approx(0.25 * plan.prediction.tokens_per_s)
    assert f"vs predicted {0.25 * plan.prediction.tokens_per_s:,.0f};" in tokens_line(report)
    # Lines from before (a run resumed across the change): their computed "tokens" still count as computed.
    report = build_report(plan, records(_lines(plan, labels, step_s, old=True)), {}, "run")
    assert report["computed_tokens_per_step"] == COMPUTED
    assert report["measured_tokens_per_s"] == pytest.approx(1000 / step_s)
