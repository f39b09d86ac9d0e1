"""Where a user watches a run: progress lines while it runs with stdout piped (`hetero run ... | tee log`, nohup,
ssh), and TensorBoard event files in the run directory, read back with TensorBoard's own reader."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from metrics_rows import read_metrics, step_line, step_lines
from plans import free_ports, make_plan
from procs import clean_up, finish, start

from hetero.runtime.run.metrics_file import EvalLine
from hetero.runtime.run.tensorboard import EventWriter, crc32c
from hetero.specs import ModelSpec, TrainSpec

STEPS = 24


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    clean_up()


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``folder``, by tag, as TensorBoard shows them (its own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(folder), purge_orphaned_data=True)
    board.Reload()
    return {tag: [(e.step, e.value) for e in board.Scalars(tag)] for tag in board.Tags()["scalars"]}


def test_a_piped_run_prints_progress_while_it_runs_and_writes_tensorboard(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                            tmp_path: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3],
                     train=TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=STEPS, lr=1e-3))
    plan.save(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    # stdout is a pipe, as under `| cat`: no bar, plain lines, and they arrive while the run goes on.
    run = start(["run", "plan.json", "--run-dir", str(run_dir), "--port", str(free_ports(1)[0])], tmp_path)
    assert run.stdout is not None
    seen: list[str] = []
    for line in run.stdout:
        seen.append(line.rstrip("\n"))
        if line.startswith("step 1/"):
            assert run.poll() is None, "the first progress line came only when the run had ended"
            break
    else:
        raise AssertionError(f"no progress line: {seen}\n{run.stderr.read() if run.stderr else ''}")
    code, out, err = finish(run)
    assert code == 0, err[-3000:]
    assert any(f"step {STEPS}/{STEPS} (100%)" in line for line in out.splitlines()), out
    assert "run directory" in "\n".join(seen + err.splitlines())  # the start-up line says where things are

    # TensorBoard: the same numbers as metrics.jsonl, step 1 being the first optimizer step (issue 53: one numbering).
    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    scalars = _scalars(run_dir / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert [v for _, v in scalars["train/trained_tokens_per_s"]] == pytest.approx(
        [m["tokens_per_s"] for m in metrics], rel=1e-6)
    assert {"train/learning_rate", "train/grad_norm", "train/step_time_s"} <= set(scalars)


def test_a_resumed_run_replaces_the_steps_it_trains_again(tmp_path: Path) -> None:
    """A run resumed (or recovered) from step 5 writes a new file; TensorBoard shows steps 6.. from it, not the old."""
    first = EventWriter(tmp_path)
    for step in range(1, 9):
        first.step(step_line(step=step, loss=9.0 + step))
    first.close()
    time.sleep(0.01)
    second = EventWriter(tmp_path, start_step=5)
    for step in range(6, 11):
        second.step(step_line(step=step, loss=19.0 + step))
    second.evaluation(EvalLine(step=10, eval_loss=1.5))
    second.close()
    scalars = _scalars(tmp_path)
    assert scalars["train/loss"] == [(1, 10.0), (2, 11.0), (3, 12.0), (4, 13.0), (5, 14.0), (6, 25.0), (7, 26.0),
                                     (8, 27.0), (9, 28.0), (10, 29.0)]
    assert scalars["eval/loss"] == [(10, 1.5)]


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C (RFC 3720, B.4)
    assert crc32c(b"") == 0


def test_tensorboard_serves_the_run_dir(tmp_path: Path) -> None:
    """`tensorboard --logdir RUN_DIR/tensorboard` (what docs/running.md says) finds the run."""
    writer = EventWriter(tmp_path / "tensorboard")
    writer.step(step_line(step=1, loss=2.5))
    writer.close()
    done = subprocess.run([sys.executable, "-m", "tensorboard.main", "--inspect", "--logdir", str(tmp_path / "tensorboard")],
                          capture_output=True,
                          text=True, timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "train/loss" in done.stdout, done.stdout[-2000:]


def test_runtime_wandb_logs_the_same_steps_to_weights_and_biases(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                  tmp_path: Path, monkeypatch) -> None:
    """W&B is not installed here (and has no network): a stand-in module records what hetero asks of it."""
    import importlib.machinery
    import types

    from hetero.runtime.cli import main_run

    calls: list[tuple] = []

    class Run:
        def log(self, data: dict, step: int) -> None:
            calls.append(("log", step, dict(data)))

        def finish(self) -> None:
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3],
                     train=TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=4, lr=1e-3))
    plan.save(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(run_dir), "--port", str(free_ports(1)[0]),
                     "--no-progress", "runtime.wandb=home-lab"]) == 0
    (init, kwargs), *logged, finish = calls
    assert init == "init" and finish == ("finish",)
    assert kwargs["project"] == "home-lab" and kwargs["dir"] == str(run_dir) and kwargs["name"] == "run"
    assert kwargs["resume"] == "allow" and kwargs["config"] == plan.config
    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert [step for _, step, _ in logged] == [1, 2, 3, 4]
    assert [data["train/loss"] for _, _, data in logged] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)


def test_runtime_wandb_is_refused_in_one_line_where_it_cannot_work() -> None:
    from hetero.errors import ConfigError
    from hetero.runtime.cli import split_run_options

    with pytest.raises(ConfigError, match=r"takes a W&B project name"):
        split_run_options(["runtime.wandb=my project!"])
    if "wandb" not in sys.modules:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            with pytest.raises(ConfigError, match=r"which is not installed here: `pip install wandb`"):
                split_run_options(["runtime.wandb=home-lab"])
