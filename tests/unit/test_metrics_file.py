"""metrics.jsonl's declared lines (runtime/run/metrics_file.py): what is written reads back as the same record, older
files still read, a later format or a bad field is one line naming it, and no other module reads or writes the file."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hetero.errors import ConfigError
from hetero.runtime.run.metrics_file import (
    EvalLine,
    MetricsFile,
    MoveCause,
    RebalanceEvent,
    RecoveryEvent,
    StepLine,
    charted,
    eval_line,
    parse_line,
    read_metrics,
    to_json,
)

ROOT = Path(__file__).resolve().parents[2]

STEP = StepLine(step=3, loss=2.5, step_time_s=0.4, lr=1e-4, grad_norm=0.9, clip_coef=1.0, label_tokens=300,
                computed_tokens=512, tokens_per_s=750.0, computed_tokens_per_s=1280.0, stage_busy=[0.3, 0.2],
                stage_wall=[0.4, 0.4], stage_ops=[{"F": 0.1, "B": 0.2}, {"F": 0.05, "B": 0.1}],
                stage_cpu_ops=[{"F": 0.1}, None], stage_links=[None, {"act": 0.001}],
                stage_telemetry=[{"source": "nvml", "sm_clock_mhz": 1500.0}, None], split=[3, 3])
EVAL = EvalLine(step=3, eval_loss=2.4, eval_tokens=64, eval_s=0.2, eval_on="training stages")
MOVE = RebalanceEvent(after_step=5, cause=MoveCause(reason="stage 0 3x slower", stage=0, device="box.cpu0", slowdown=3.0),
                      old_split=[3, 3], new_split=[1, 5], old_spans=[[0, 3], [4, 7]], new_spans=[[0, 1], [2, 7]],
                      predicted_gain=2.0, move_s=0.8, split=[1, 5])
RECOVERY = RecoveryEvent(after_step=9, recovery=1, device="box.cpu1", host="box", cause="exited: killed by SIGKILL",
                         resumed_from_step=8, replayed_steps=2, old_split=[2, 2, 2], new_split=[3, 3],
                         devices=["box.cpu0", "box.cpu2"], plan="plan-recovery-1.json", stage=1, recovery_s=4.2)


def test_every_kind_of_line_reads_back_as_written(tmp_path: Path) -> None:
    written = MetricsFile(tmp_path)
    written.start(0)
    for line in (STEP, EVAL, MOVE, RECOVERY):
        written.append(line)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["format"] == 1 for r in rows) and "record_tokens" not in rows[0]  # unset fields are not written
    read = read_metrics(tmp_path / "metrics.jsonl")
    assert read.lines == [STEP, EVAL, MOVE, RECOVERY]
    assert (read.steps, read.evals, read.moves, read.recoveries) == ([STEP], [EVAL], [MOVE], [RECOVERY])
    # The coordinator's clock at a loss is kept in memory, not written.
    assert "lost_at" not in json.loads(to_json(RecoveryEvent(**{**RECOVERY.__dict__, "lost_at": 12.5})))


def test_older_lines_read_and_unknown_fields_are_skipped() -> None:
    # Before trained tokens were counted (format 0): "tokens" was the computed count and tokens_per_s its rate.
    old = parse_line({"step": 1, "loss": 2.0, "step_time_s": 0.5, "label_tokens": 100, "tokens": 512,
                      "tokens_per_s": 1024.0, "stage_busy": [0.1], "stage_ops": [{"F": 0.1}]})
    assert isinstance(old, StepLine)
    assert (old.computed_tokens, old.computed_tokens_per_s, old.tokens_per_s) == (512, 1024.0, 200.0)
    later_field = parse_line({**json.loads(to_json(STEP)), "a_field_of_later": [1, 2]})
    assert later_field == STEP
    assert parse_line({"note": "not a line of any kind"}) is None and parse_line([1, 2]) is None


def test_a_later_format_or_a_bad_field_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="format 2, this hetero reads format 1"):
        parse_line({**json.loads(to_json(STEP)), "format": 2})
    path = tmp_path / "metrics.jsonl"
    path.write_text(to_json(STEP) + "\n" + json.dumps({"step": "three", "loss": 2.0, "step_time_s": 0.1}) + "\n")
    with pytest.raises(ConfigError) as err:
        read_metrics(path)
    assert str(err.value).endswith("line 2.step: expected an integer, got 'three'") and "\n" not in str(err.value)
    path.write_text(to_json(STEP) + "\nnot json\n" + to_json(STEP) + "\n")
    assert len(read_metrics(path).steps) == 2  # a line a crash cut short is skipped when reading a live run
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        read_metrics(path, strict=True)  # ... and named where a finished run is compared with its plan


def test_an_evaluators_answer_becomes_its_line_or_the_error_it_names() -> None:
    assert eval_line({"step": 3, "eval_loss": 2.4, "eval_tokens": 64, "eval_s": 0.2}) == EvalLine(
        step=3, eval_loss=2.4, eval_tokens=64, eval_s=0.2)
    assert eval_line({"error": "held-out data ran out"}) == "held-out data ran out"
    assert "expected a number" in str(eval_line({"step": 3, "eval_loss": "low"}))


def test_trackers_chart_what_the_line_has() -> None:
    assert charted(STEP) == {"train/loss": 2.5, "train/learning_rate": 1e-4, "train/grad_norm": 0.9,
                             "train/clip_coef": 1.0, "train/trained_tokens_per_s": 750.0,
                             "train/computed_tokens_per_s": 1280.0, "train/step_time_s": 0.4}
    assert charted(StepLine(step=1, loss=2.0, step_time_s=0.5)) == {"train/loss": 2.0, "train/step_time_s": 0.5}
    assert charted(EVAL) == {"eval/loss": 2.4}


# Modules that name the file without reading its lines: a benchmark that times other trees' runs (theirs may write
# another format), and one that counts its lines as a clock.
NAMES_ONLY = {"bench/bench_startup.py", "bench/w3_runs.py"}


def test_no_other_module_opens_metrics_jsonl() -> None:
    """The file's one writer and reader is metrics_file.py: elsewhere, a path built from the file's name (``run_dir
    / "metrics.jsonl"``) is someone reading or writing its lines on their own."""
    found = []
    for folder in ("hetero", "runtime", "planner", "compiler", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel == "runtime/run/metrics_file.py" or rel in NAMES_ONLY:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                        and node.right.value == "metrics.jsonl"):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"use runtime/run/metrics_file.py (NAME, read_metrics, MetricsFile) instead: {found}"
