"""What a run keeps and shows of its steps: metrics.jsonl lines, the progress bar, the evaluator's answers,
checkpoints/step-N/ and, after the last step, adapter/.

``payload_due`` (runtime/base/payloads.py) is the rule both sides follow: after which steps the stages send their state (a
checkpoint, the adapter for the evaluator, the last) and the coordinator gathers it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetero.errors import WireError
from hetero.plan import Plan
from hetero.protocol import StepDone
from hetero.runtime.base.payloads import checkpoint_due
from hetero.runtime.run.metrics_file import EvalLine, Event, MetricsFile, StepLine, eval_line
from hetero.runtime.stage.telemetry import clean_telemetry
from hetero.runtime.wire.frames import record_of
from hetero.serde import to_dict
from hetero.specs import RUNTIME_OVERRIDABLE

if TYPE_CHECKING:
    import torch

# What a person reads counts steps from 1: the progress bar, metrics.jsonl's ``step`` (and an event's ``after_step``:
# the steps done before it), loss.png, steps.png, TensorBoard, W&B, checkpoints/step-N (N steps done) and every line
# of the terminal. The wire, the schedules and the data count from 0: step index i is the step numbered i + 1.
STEP_NUMBERS = "from 1"


@dataclass
class RunResult:
    steps: list[StepLine] = field(default_factory=list)  # the metrics.jsonl step lines of this run
    environments: dict[str, Any] = field(default_factory=dict)
    build_s: dict[int, float] = field(default_factory=dict)
    interrupted_after: int | None = None  # Ctrl-C / SIGTERM: the steps done when training stopped
    checkpoint: Path | None = None  # ... and the checkpoint that holds them (None: no step was done)
    evals: list[EvalLine] = field(default_factory=list)  # the evaluations' lines
    eval_errors: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # metrics.jsonl's event lines (moves, recoveries)


def throughput(plan: Plan, label_tokens: int, step_time: float, record_tokens: int | None = None) -> dict[str, Any]:
    """A step's token counts for its metrics.jsonl line (StepLine's fields): ``tokens_per_s`` counts trained (label) tokens, the tokens
    the loss is over; ``computed_tokens`` (every row's seq_len tokens, padding included) and its rate beside it;
    ``record_tokens`` (the step's tokens that are not padding) where the caller knows them."""
    train = plan.train
    computed = train.num_micro_batches * train.micro_batch_size * plan.model.seq_len
    out: dict[str, Any] = {"label_tokens": int(label_tokens), "computed_tokens": computed}
    if record_tokens is not None:
        out["record_tokens"] = int(record_tokens)
    out.update(step_time_s=step_time, tokens_per_s=label_tokens / step_time,
               computed_tokens_per_s=computed / step_time)
    return out


def metrics_line(plan: Plan, step: int, done: dict[int, Any], grad_norm: float, coef: float,
                 label_tokens: int, step_time: float, record_tokens: int | None = None) -> StepLine:
    """Step ``step``'s metrics.jsonl line from every stage's ``stepdone`` (loss over the step's ``label_tokens``;
    ``record_tokens``: the step's tokens that are not padding, StepBatch.num_tokens, when the caller passes them).
    ``step`` counts from 0, as the wire does; the line's ``step`` is the step's number, from 1 (STEP_NUMBERS)."""
    reports = [record_of(done[k], StepDone) for k in range(len(plan.stages))]
    sums = [reports[rep.stages[-1]].loss_sum for rep in plan.pipelines]
    if any(x is None for x in sums):
        raise WireError(f"step {step + 1}: a pipeline's last stage reported no loss")
    loss = sum(float(x) for x in sums if x is not None) / label_tokens
    streams = any(sp.stream_layers for sp in plan.stages)  # only plans that stream: the others' lines stay as they were
    return StepLine(
        step=step + 1, loss=loss, lr=float(reports[0].lr), grad_norm=grad_norm, clip_coef=coef,
        **throughput(plan, label_tokens, step_time, record_tokens),
        stage_busy=[float(r.busy_s) for r in reports], stage_wall=[float(r.wall_s) for r in reports],
        stage_ops=[r.op_time_s for r in reports], stage_cpu_ops=[r.op_cpu_s for r in reports],
        stage_links=[r.link_s for r in reports], stage_telemetry=[clean_telemetry(r.telemetry) for r in reports],
        stage_streamed_bytes=[r.streamed_bytes for r in reports] if streams else None,
        stage_frozen_resident_peak_bytes=[r.frozen_resident_peak_bytes for r in reports] if streams else None)


class RunRecords:
    """The run directory's record of training, and the evaluator client (runtime/run/eval_client.py) it feeds."""

    def __init__(self, plan: Plan, run_dir: Path, wandb: str | None = None) -> None:
        self.plan, self.run_dir = plan, run_dir
        self.wandb = wandb  # runtime.wandb: a W&B project to log to (runtime/run/wandb_log.py)
        self.result = RunResult()
        self.metrics = MetricsFile(run_dir)
        self.evaluator: Any = None  # EvalClient when eval.every > 0
        # From start_metrics on: TensorBoard's EventWriter (runtime/run/tensorboard.py), and W&B when asked for.
        self.trackers: list[Any] = []

    def open_evaluator(self, plan_path: Path, host: str) -> None:
        """Start the evaluator on a spare device of ``host`` when the plan evaluates every N steps there
        (eval.device; without it the training stages evaluate: runtime/run/stage_eval.py)."""
        if self.plan.eval.every > 0 and self.plan.eval.device is not None:
            from hetero.runtime.run.eval_client import EvalClient, eval_device_name

            device = eval_device_name(self.plan, self.plan.eval, host)
            self.evaluator = EvalClient(plan_path, self.plan, device, self.run_dir)

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        self._close_trackers()

    def start_metrics(self, start_step: int, recovering: bool = False) -> None:
        """metrics.jsonl: empty for a new run; a resumed one keeps the lines of the steps before it. A run that goes
        on after a lost device (``recovering``: runtime.elastic) keeps every recovery line too: a device lost is
        history even where the steps around the loss are trained again (a second loss may resume from a copy older
        than the first, or before the first step)."""
        self.metrics.start(start_step, recovering)
        from hetero.runtime.run.tensorboard import EventWriter

        self._close_trackers()
        self.trackers = [EventWriter(self.run_dir / "tensorboard", start_step)]
        if self.wandb:
            from hetero.runtime.run.wandb_log import WandbRun

            self.trackers.append(WandbRun(self.wandb, self.run_dir, self.plan.config))

    def _close_trackers(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def step(self, line: StepLine) -> None:
        """One step's metrics line, kept and appended to metrics.jsonl."""
        self.result.steps.append(line)
        self.metrics.append(line)
        for tracker in self.trackers:
            tracker.step(line)

    def event(self, line: Event) -> None:
        """An event of the run (a move, a recovery), kept and appended to metrics.jsonl."""
        self.result.events.append(line)
        self.metrics.append(line)

    def record_eval(self, answers: list[Any] | None = None) -> None:
        """The evaluator's answers so far (or ``answers``: the training stages' EvalLine) as metrics.jsonl lines; an
        answer that is no evaluation is said, and kept among the run's eval_errors."""
        if self.evaluator is None and answers is None:
            return
        for answer in self.evaluator.poll() if answers is None else answers:
            line = eval_line(answer)
            if isinstance(line, EvalLine):
                self.result.evals.append(line)
                self.metrics.append(line)
                for tracker in self.trackers:
                    tracker.evaluation(line)
            else:
                self.result.eval_errors.append(line)
                print(f"hetero run: evaluation: {line}", file=sys.stderr, flush=True)

    def _eval_wait_s(self) -> float:
        slowest = max((a.eval_s or 0.0 for a in self.result.evals), default=0.0)
        return max(300.0, 3 * slowest)

    def finish_eval(self) -> None:
        """Wait for the last evaluation (the final step's) and record what is left."""
        if self.evaluator is None:
            return
        self.record_eval(self.evaluator.finish(timeout_s=self._eval_wait_s()))
        if self.evaluator.skipped:
            print(f"hetero run: evaluation skipped after step(s) {', '.join(map(str, self.evaluator.skipped))}"
                  f": the evaluation before was still running on {self.evaluator.device} (raise eval.every)",
                  file=sys.stderr, flush=True)

    def save_payloads(self, step: int, payloads: dict[int, Any]) -> None:
        """The stages' state after ``step`` (``payload_due``): to the evaluator, into a checkpoint when one
        is due, and after the last step into adapter/."""
        from hetero.runtime.run.checkpoint import lora_from_payload

        train, every = self.plan.train, self.plan.eval.every
        final = step + 1 == train.steps
        state: dict[str, torch.Tensor] = {}
        for k in self.plan.pipelines[0].stages:  # every replica holds the same adapter
            state.update(lora_from_payload(payloads[k].tensors))
        if self.evaluator is not None and (final or (step + 1) % every == 0):
            # The last step's evaluation waits for the one before (training is over).
            self.record_eval(self.evaluator.request(step + 1, state, wait_s=self._eval_wait_s() if final else 0.0))
        if checkpoint_due(train, step):
            self.write_checkpoint(step + 1, payloads)
        if final:
            self._save_adapter(state)

    def write_checkpoint(self, done: int, payloads: dict[int, Any], snapshot: bool = False) -> Path:
        """checkpoints/step-<done>/, with the training settings `--resume` continues with. A ``snapshot`` (the
        run's time-based checkpoint) is marked so, and only the newest SNAPSHOTS_KEPT of them stay."""
        # Replicas hold identical LoRA and AdamW state (they apply the same summed gradients): the first
        # replica's stages (0..S-1) are the whole model, in the same key space as any other split.
        first = self.plan.pipelines[0].stages
        return self._write(done, [(payloads[k].tensors, payloads[k].meta) for k in first], snapshot)

    def write_state(self, state: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> Path:
        """A snapshot of the whole model's state as one union (tensors, meta): what the coordinator kept in memory
        (runtime.elastic) goes to disk when the run stops on a failure, so its resume command loses nothing."""
        tensors, meta = state
        return self._write(int(meta["step"]), [(tensors, {**meta, "stage": 0})], snapshot=True)

    def _write(self, done: int, parts: list[tuple[dict[str, torch.Tensor], dict[str, Any]]], snapshot: bool) -> Path:
        from hetero.runtime.run.checkpoint import prune_snapshots, state_settings, write_checkpoint

        settings = {k: v for k, v in to_dict(self.plan.train).items() if k in RUNTIME_OVERRIDABLE}
        depends_on = state_settings(to_dict(self.plan.model.lora), self.plan.model.architecture)
        written = write_checkpoint(self.run_dir, done, parts, len(parts), train=settings, snapshot=snapshot,
                                   depends_on=depends_on)
        if snapshot:
            prune_snapshots(self.run_dir)
        return written

    def _save_adapter(self, state: dict[str, torch.Tensor]) -> None:
        from hetero.runtime.pretrained import adapter_base
        from hetero.runtime.stage.adapter import save_adapter

        base = adapter_base(self.plan.model)  # a directory AutoPeftModelForCausalLM can load, or a hub id
        save_adapter({k: v.clone() for k, v in state.items()}, self.plan.model.lora, base, self.run_dir / "adapter")


# Off a terminal (`hetero run ... | tee log`, nohup, a redirected ssh session) progress is a plain line this often,
# and after the first and the last step.
PLAIN_PROGRESS_EVERY_S = 30.0


class ProgressBar:
    """A rich live bar (step, loss, trained tokens/s, ETA) when stdout is a terminal; otherwise a plain line after
    the first step, every PLAIN_PROGRESS_EVERY_S, and after the last (nothing with ``--no-progress``)."""

    def __init__(self, total: int, enabled: bool, every_s: float = PLAIN_PROGRESS_EVERY_S, first: int = 0) -> None:
        """``first``: the step this run starts from (a resume's): its ETA counts only this run's steps."""
        self.enabled = enabled and sys.stdout.isatty()
        self.plain = enabled and not self.enabled
        self.total, self.every_s, self.first = total, every_s, first
        self.started = self.printed = time.monotonic()
        self.lines = 0
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} trained tok/s"),
                                TextColumn("ETA"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=first, loss="-", tps="-")

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            self.bar.__enter__()
        self.started = self.printed = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """After ``step``: its loss and trained (label) tokens/s (a metrics line's ``tokens_per_s``)."""
        if self.enabled:
            self.bar.update(self.task, completed=step + 1, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")
        if not self.plain:
            return
        now = time.monotonic()
        if self.lines and now - self.printed < self.every_s and step + 1 < self.total:
            return
        self.lines += 1
        self.printed = now
        print(plain_progress(step, self.total, loss, tokens_per_s, now - self.started, self.first), flush=True)


def plain_progress(step: int, total: int, loss: float, tokens_per_s: float, elapsed_s: float, first: int = 0) -> str:
    """One progress line: ``step 12/200 (6%)  loss 1.2345  3,456 trained tok/s  elapsed 0:01:23  ETA 0:22:10``;
    ``elapsed`` and the ETA count this run's steps only (``first``: where a resumed run started)."""
    done = step + 1
    ran = done - first
    left = elapsed_s / ran * (total - done) if ran > 0 else 0.0
    return (f"step {done}/{total} ({done / max(total, 1):.0%})  loss {loss:.4f}  {tokens_per_s:,.0f} trained tok/s  "
            f"elapsed {_clock(elapsed_s)}  ETA {_clock(left)}")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
