"""`hetero run`: the coordinator. Starts this host's stages, waits for remote ones, feeds data, clips, records.

Per optimizer step it sends the step's input ids to stage 0 and labels to the last stage, gathers
every stage's squared gradient norm, answers with the global clip coefficient (the math of
``clip_grad_norm_`` on one GPU), and writes one metrics.jsonl line from the stages' ``stepdone``.
Checkpoint messages become checkpoints/step-N/ files; the last one also becomes adapter/.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetero.errors import HeteroError, WireError
from hetero.plan import Plan
from hetero.runtime.executor import COORDINATOR, stage_name
from hetero.runtime.worker import (
    Heartbeat,
    Mailbox,
    PeerError,
    StopRequested,
    coordinator_endpoint,
    drop_unsent,
    is_timeout,
    spawn_stages,
    stop_processes,
)
from hetero.serde import to_dict


class StageFailedError(HeteroError):
    """A stage process reported an error, exited, or went silent."""


@dataclass
class RunOptions:
    run_dir: Path
    host: str | None = None  # the host this coordinator runs on (default: stage 0's)
    port: int | None = None  # coordinator port (default: that host's base port - 1)
    handshake_timeout_s: float = 600.0  # remote hosts may still be loading or quantizing weights
    step_timeout_s: float = 1800.0
    silence_s: float = 60.0  # a peer without heartbeat for this long is dead
    progress: bool = True
    resume: Path | None = None  # a checkpoints/step-N directory (of this or another split of the model)


@dataclass
class RunResult:
    steps: list[dict[str, Any]] = field(default_factory=list)  # the metrics.jsonl lines
    environments: dict[str, Any] = field(default_factory=dict)
    build_s: dict[int, float] = field(default_factory=dict)


class Coordinator:
    """Drives one training run of a plan; see the module docstring."""

    def __init__(self, plan: Plan, plan_path: Path, options: RunOptions) -> None:
        from hetero.runtime.transport import Transport

        self.plan, self.plan_path, self.options = plan, plan_path, options
        self.run_dir = options.run_dir
        self.num_stages = len(plan.stages)
        self.host = options.host or plan.stages[0].host
        self.endpoint = coordinator_endpoint(plan, self.host, options.port)
        self.transport = Transport(COORDINATOR, self.endpoint, plan.input_hash, recv_timeout_s=300.0)
        self.names = [stage_name(k) for k in range(self.num_stages)]
        for k, sp in enumerate(plan.stages):
            self.transport.connect(self.names[k], sp.endpoint)
        self.procs: dict = {}
        self.mailbox = Mailbox(self.transport, silence_s=options.silence_s, on_idle=self._check_children)
        self.heartbeat = Heartbeat(self.transport, self.names)
        self.result = RunResult()
        self.start_step = 0  # > 0 when resuming from a checkpoint

    # -- lifecycle --------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Train for plan.train.steps steps; raises HeteroError (one line) when anything fails."""
        local = [s.index for s in self.plan.stages if s.host == self.host]
        remote = sorted({s.host for s in self.plan.stages if s.host != self.host})
        self.procs = spawn_stages(self.plan_path, local, self.run_dir, self.endpoint)
        if remote:
            print(f"hetero run: waiting for hosts {', '.join(remote)}: on each, run "
                  f"`hetero worker plan.json --host NAME --coordinator {self.endpoint}`", flush=True)
        self.heartbeat.start()
        try:
            # Tokenize while the stages import and build (before anyone watches for silence).
            batches = self._batches()
            self._handshake()
            self._train(batches)
            self.heartbeat.stopped.set()  # nothing may queue behind the stop for stages about to exit
            self._broadcast("stop", {"reason": "training finished"})
            stop_processes(self.procs)
        except BaseException as exc:
            self.heartbeat.stopped.set()
            reason = "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else f"run failed: {exc}"
            self._broadcast("stop", {"reason": reason})
            stop_processes(self.procs, grace_s=5.0)
            # Dead stages never take what is queued for them: give live remote ones a second, not 10.
            drop_unsent(self.transport, linger_ms=1000)
            if isinstance(exc, (PeerError, StopRequested)):
                raise StageFailedError(f"{exc} (logs: {self.run_dir / 'logs'})") from None
            raise
        finally:
            self.heartbeat.stopped.set()
            self.heartbeat.join(timeout=5)
            self.transport.close()
        return self.result

    def _broadcast(self, kind: str, meta: dict[str, Any]) -> None:
        for name in self.names:
            try:
                self.transport.send(name, kind, meta=meta)
            except Exception:  # best effort while shutting down
                pass

    def _check_children(self) -> None:
        for k, p in self.procs.items():
            code = p.poll()
            if code is not None and code != 0:
                raise StageFailedError(
                    f"stage {k} exited with code {code}: {_last_error_line(self.run_dir / 'logs' / f'stage{k}.log')} "
                    f"(log: {self.run_dir / 'logs' / f'stage{k}.log'})"
                )

    def _gather(self, kind: str, step: int, timeout_s: float) -> dict[int, Any]:
        """One ``kind`` message for ``step`` from every stage, keyed by stage index."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.num_stages:
            try:
                msg = self.mailbox.recv(kind, step=step, timeout_s=max(0.0, deadline - time.monotonic()))
            except WireError as exc:
                if not is_timeout(exc):
                    raise
                missing = sorted(set(range(self.num_stages)) - set(got))
                raise StageFailedError(self._missing(kind, step, timeout_s, missing)) from None
            if msg.sender not in self.names:
                raise WireError(f"'{kind}' from unknown peer {msg.sender!r}")
            got[self.names.index(msg.sender)] = msg
        return got

    def _missing(self, kind: str, step: int, timeout_s: float, missing: list[int]) -> str:
        """A one-line explanation of who did not answer, and what to do about it."""
        hosts = sorted({self.plan.stages[k].host for k in missing})
        remote = [h for h in hosts if h != self.host]
        what = f"stage(s) {', '.join(map(str, missing))} on {', '.join(hosts)} sent no '{kind}'"
        what += f" for step {step}" if kind not in ("hello", "start") else ""
        hint = f"see {self.run_dir / 'logs'}"
        if kind == "hello" and remote:
            hint = (f"is `hetero worker plan.json --host {remote[0]} --coordinator {self.endpoint}` running there, "
                    "and can it reach this host?")
        return f"{what} within {timeout_s:g} s: {hint}"

    def _handshake(self) -> None:
        """hello from every stage (same plan, same wire version), then welcome with the run settings."""
        from hetero.runtime.wire import WIRE_VERSION

        timeout = self.options.handshake_timeout_s
        hellos = self._gather("hello", 0, timeout)
        for k, msg in sorted(hellos.items()):
            meta = msg.meta
            if meta.get("input_hash") != self.plan.input_hash or meta.get("stage") != k:
                raise StageFailedError(
                    f"stage {k} runs plan {meta.get('input_hash')} as stage {meta.get('stage')}, this coordinator "
                    f"runs {self.plan.input_hash}: restart every host with the same plan.json"
                )
            if meta.get("wire_version") != WIRE_VERSION:
                raise StageFailedError(f"stage {k} speaks wire v{meta.get('wire_version')}, this coordinator v{WIRE_VERSION}: "
                                       "install the same hetero version on every host")
            self.result.environments[f"stage{k}"] = {"host": self.plan.stages[k].host, **meta.get("env", {})}
        (self.run_dir / "environments.json").write_text(json.dumps(self.result.environments, indent=1, default=str))
        now = time.monotonic()
        self.mailbox.last_seen = {name: now for name in self.names}  # from now on, silence means death
        resume = None
        if self.options.resume is not None:
            from hetero.runtime.checkpoint import load_checkpoint_union

            resume = load_checkpoint_union(self.options.resume)
            self.start_step = int(resume[1]["step"])
            if self.start_step >= self.plan.train.steps:
                raise StageFailedError(f"{self.options.resume} is after step {self.start_step}, train.steps is "
                                       f"{self.plan.train.steps}: raise it (hetero run ... steps=N) to train on")
        welcome = {"train": to_dict(self.plan.train), "silence_s": self.options.silence_s,
                   "start_step": self.start_step, "resume": resume is not None}
        for name in self.names:
            self.transport.send(name, "welcome", meta=welcome)
        ready = self._gather("start", 0, timeout)
        self.result.build_s = {k: float(m.meta.get("build_s", 0.0)) for k, m in ready.items()}
        if resume is not None:
            from hetero.runtime.checkpoint import select_payload

            for k, msg in ready.items():
                tensors, meta = select_payload(*resume, list(msg.meta["keys"]), k)
                self.transport.send(self.names[k], "state", tensors=tensors, meta=meta)

    # -- training ---------------------------------------------------------------------------------

    def _send_data(self, batches: Any, step: int) -> int:
        batch = batches.step(step)
        self.transport.send(self.names[0], "batch", step=step, tensors={"input_ids": batch.input_ids})
        self.transport.send(self.names[-1], "labels", step=step, tensors={"labels": batch.labels},
                            meta={"num_label_tokens": batch.num_label_tokens})
        return int(batch.num_label_tokens)

    def _batches(self) -> Any:
        from hetero.pretrained import resolve_dir
        from hetero.runtime.data import StepBatches

        plan, train = self.plan, self.plan.train
        return StepBatches(plan.data, resolve_dir(plan.model), plan.model.seq_len, train.micro_batch_size,
                           train.num_micro_batches, train.seed, train.shuffle)

    def _train(self, batches: Any) -> None:
        from hetero.runtime.checkpoint import checkpoint_dir, lora_from_payload, save_stage_checkpoint

        plan, train = self.plan, self.plan.train
        tokens_per_step = train.num_micro_batches * train.micro_batch_size * plan.model.seq_len
        metrics_path = self.run_dir / "metrics.jsonl"
        metrics_path.write_text("")
        timeout = self.options.step_timeout_s
        progress = _Progress(train.steps, self.options.progress)
        first = self.start_step
        label_tokens = {first: self._send_data(batches, first)}
        last = time.perf_counter()
        with progress:
            for step in range(first, train.steps):
                norms = self._gather("gradnorm", step, timeout)
                grad_norm = math.sqrt(sum(float(m.meta["sumsq"]) for m in norms.values()))
                coef = 1.0
                if train.max_grad_norm > 0:
                    # clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6), never above 1.
                    coef = min(1.0, train.max_grad_norm / (grad_norm + 1e-6))
                for name in self.names:
                    self.transport.send(name, "clip", step=step, meta={"coef": coef, "grad_norm": grad_norm})
                if step + 1 < train.steps:  # the next step's data travels while this one finishes
                    label_tokens[step + 1] = self._send_data(batches, step + 1)
                done = self._gather("stepdone", step, timeout)
                now = time.perf_counter()
                step_time, last = now - last, now
                last_meta = done[self.num_stages - 1].meta
                loss = float(last_meta["loss_sum"]) / label_tokens.pop(step)
                line = {
                    "step": step, "loss": loss, "lr": float(done[0].meta["lr"]), "grad_norm": grad_norm,
                    "clip_coef": coef, "tokens": tokens_per_step, "label_tokens": int(last_meta["num_label_tokens"]),
                    "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                    "stage_busy": [float(done[k].meta["busy_s"]) for k in range(self.num_stages)],
                    "stage_ops": [done[k].meta["op_time_s"] for k in range(self.num_stages)],
                }
                self.result.steps.append(line)
                with metrics_path.open("a") as f:
                    f.write(json.dumps(line) + "\n")
                progress.update(step, loss, line["tokens_per_s"])
                final = step + 1 == train.steps
                if final or (train.checkpoint_every > 0 and (step + 1) % train.checkpoint_every == 0):
                    payloads = self._gather("checkpoint", step, timeout)
                    directory = checkpoint_dir(self.run_dir, step + 1)
                    for msg in payloads.values():
                        save_stage_checkpoint(directory, msg.tensors, msg.meta)
                    (directory / "COMPLETE").write_text(json.dumps({"stages": self.num_stages, "step": step + 1}))
                    if final:
                        state: dict[str, torch.Tensor] = {}
                        for msg in payloads.values():
                            state.update(lora_from_payload(msg.tensors))
                        self._save_adapter(state)

    def _save_adapter(self, state: dict[str, torch.Tensor]) -> None:
        from hetero.runtime.adapter import save_adapter

        base = self.plan.model.pretrained or self.plan.model.name
        save_adapter({k: v.clone() for k, v in state.items()}, self.plan.model.lora, base, self.run_dir / "adapter")


def _last_error_line(log: Path) -> str:
    """The most telling line of a stage log: its last 'hetero: error' line, else its last line."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["empty log"])[-1][:300]


class _Progress:
    """A rich live bar (step, loss, tokens/s, ETA) when stdout is a terminal; silent otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled and sys.stdout.isatty()
        self.total = total
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                TextColumn("ETA"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, loss="-", tps="-")

    def __enter__(self) -> _Progress:
        if self.enabled:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.enabled:
            self.bar.update(self.task, completed=step + 1, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")

