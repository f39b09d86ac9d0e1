"""Run one stage's program for one optimizer step: a type -> handler table over hetero.program Actions.

Semantics (shared with the planner's simulator, see hetero/program.py): sends are asynchronous,
receives block; stage 0's F reads micro-batch ``mb`` of the step's input ids, the last stage's F
computes the summed token cross-entropy and its B starts from ``loss_sum / num_label_tokens`` of the
whole step — so accumulating over micro-batches gives exactly the one-GPU gradient. STEP clips by
the *global* gradient norm (every stage's squared norm summed by the coordinator) and steps AdamW.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from hetero.errors import TrainingDivergedError, WireError
from hetero.program import Action
from hetero.protocol import Act, Clip, Grad, GradNorm, Labels, Record, Reduced
from hetero.runtime.stage.lora import peft_key
from hetero.runtime.stage.loss import chunked_loss_sum
from hetero.runtime.stage.lr import make_scheduler
from hetero.runtime.stage.model import Stage
from hetero.runtime.stage.telemetry import open_telemetry
from hetero.runtime.stage.telemetry import sample as sample_telemetry
from hetero.runtime.wire import compress
from hetero.runtime.wire.frames import accumulate_dtype, record_of
from hetero.security import COORDINATOR, stage_name
from hetero.specs import TrainSpec

COMPUTE_OPS = ("F", "B", "STEP")  # what counts as a stage's busy time; the rest is waiting or sending
CPU_TIMED_OPS = ("RA", "F", "SA", "RG", "B", "SG", "STEP")  # a CPU stage also records their process CPU time


def build_optimizer(params: list[torch.nn.Parameter], train: TrainSpec) -> tuple[Any, Any]:
    """AdamW and its LR schedule over a stage's LoRA parameters ((None, None) when it has none)."""
    if not params:
        return None, None
    # torch defaults (betas, eps) like the one-GPU reference; AdamW is per-element, so splitting
    # the parameters across stages changes nothing.
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    return optimizer, make_scheduler(optimizer, train)


def grad_sumsq(params: list[torch.nn.Parameter]) -> float:
    """Squared L2 norm of the gradients, in float64 (the stage's share of the global norm)."""
    with torch.no_grad():
        return float(sum((p.grad.double().pow(2).sum() for p in params if p.grad is not None),
                         torch.zeros((), dtype=torch.float64)))


def apply_step(params: list[torch.nn.Parameter], optimizer: Any, scheduler: Any, coef: float) -> None:
    """Scale gradients by the clip coefficient, step AdamW and the schedule, drop the gradients."""
    if optimizer is None:
        return
    with torch.no_grad():
        if coef != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


class Wire(Protocol):
    """The part of hetero.runtime.wire.transport.Transport the executor uses."""

    def send(self, peer: str, kind: str | Record, *, step: int = 0, mb: int = -1,
             tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None) -> None: ...

    def recv(self, kind: str | None = None, *, step: int | None = None, mb: int | None = None,
             sender: str | None = None, timeout_s: Any = ..., chunk: int | None = None) -> Any: ...


@dataclass
class StepStats:
    """What one stage measured during one optimizer step (sent to the coordinator as ``stepdone``)."""

    step: int
    loss_sum: float | None  # last stage: summed token cross-entropy of the step
    num_label_tokens: int | None
    grad_sumsq: float  # this stage's squared LoRA gradient norm, before clipping
    lr: float  # the learning rate this step used
    busy_s: float  # F + B + optimizer time
    wall_s: float
    op_time_s: dict[str, float] = field(default_factory=dict)  # per action type
    # A CPU stage's process CPU seconds in F, B and STEP: its own work, without the waits for a core that a host
    # with fewer cores than its stages' threads adds to the wall times (runtime/run/run_profile.py).
    op_cpu_s: dict[str, float] = field(default_factory=dict)
    # Per received kind ("act", "grad"): median seconds from the sender's hand-off to holding the message, over the
    # messages this stage was already waiting for (a queued one's time on the link is unknown).
    link_s: dict[str, float] = field(default_factory=dict)
    telemetry: dict[str, Any] | None = None  # the device's clocks/temperature after the step (GPUs with NVML/amdsmi)
    # A stage that streams weights (plan stream_layers): bytes copied host-to-device in the step, and the most
    # frozen-weight bytes it held on the device at once (runtime/stage/streaming.py); None where nothing streams.
    streamed_bytes: int | None = None
    frozen_resident_peak_bytes: int | None = None

    def to_meta(self) -> dict[str, Any]:
        meta = {"step": self.step, "loss_sum": self.loss_sum, "num_label_tokens": self.num_label_tokens,
                "grad_sumsq": self.grad_sumsq, "lr": self.lr, "busy_s": self.busy_s, "wall_s": self.wall_s,
                "op_time_s": dict(self.op_time_s)}
        if self.op_cpu_s:
            meta["op_cpu_s"] = dict(self.op_cpu_s)
        if self.link_s:
            meta["link_s"] = dict(self.link_s)
        if self.streamed_bytes is not None:
            meta["streamed_bytes"] = self.streamed_bytes
            meta["frozen_resident_peak_bytes"] = self.frozen_resident_peak_bytes
        return meta if self.telemetry is None else {**meta, "telemetry": self.telemetry}


class Executor:
    """Executes a stage's program step after step; owns the stage's optimizer and LR schedule."""

    # A profiler's seam, empty in hetero itself: each callable is told (stage index, op, step, mb, start,
    # end) after every action of every executor in this process, on time.perf_counter's clock.
    # bench/w3_timeline.py registers one in the stage processes to time W3's actions.
    action_observers: ClassVar[list[Callable[[int, str, int, int, float, float], None]]] = []

    def __init__(self, stage: Stage, program: list[Action], wire: Wire, train: TrainSpec,
                 neighbours: tuple[int | str | None, int | str | None] | None = None, replicated: bool = False,
                 compression: tuple[str, str] = ("none", "none"), chunks: tuple[int, int, int] | None = None) -> None:
        """``neighbours``: the stages before and after this one in its pipeline, by index or process name (default:
        index -+ 1); ``chunks``: under an interleaved program (runtime/stage/chunks.py), the chunk this stage is of
        its device and the chunks of the stages before and after it of theirs, which its acts and grads name;
        ``replicated``: other replicas hold the same layers, and STEP sums gradients with them; ``compression``:
        the scheme of the link from the previous stage and of the link to the next (runtime/wire/compress.py)."""
        self.stage = stage
        self.program = program
        self.wire = wire
        self.train = train
        prev, nxt = neighbours if neighbours is not None else (stage.index - 1, stage.index + 1)
        self.prev = _peer(prev) if not stage.is_first and prev is not None else None
        self.next = _peer(nxt) if not stage.is_last and nxt is not None else None
        self.replicated = replicated
        self.link_in, self.link_out = compression
        self.chunk, self.prev_chunk, self.next_chunk = chunks if chunks is not None else (None, None, None)
        self.hidden = int(stage.model.config.hidden_size)
        self.params = stage.lora_parameters()
        # Whole-model PEFT keys of the LoRA parameters (checkpoint keys; gradients travel under them).
        self.keys = [peft_key(name) for name, _ in stage.lora_named_parameters()]
        self.optimizer, self.scheduler = build_optimizer(self.params, train)
        self.telemetry = open_telemetry(stage.device)  # None on a CPU, or without NVML/amdsmi
        self.steps_done = 0  # optimizer steps taken (the step number of the next step)
        self._handlers: dict[str, Callable[[int, int], None]] = {
            "RA": self._recv_activation, "F": self._forward, "SA": self._send_activation,
            "RG": self._recv_grad, "B": self._backward, "SG": self._send_grad, "STEP": self._optimizer_step,
        }
        self._reset()

    def _reset(self) -> None:
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._input_ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None  # stage 0, packed rows: [M, B, S] positions in each record
        self._mb_positions: dict[int, torch.Tensor] = {}  # packed rows: a micro-batch's positions until sent on
        self._labels: torch.Tensor | None = None
        self._num_label_tokens: int | None = None
        self._loss_sum = 0.0
        self._grad_sumsq = 0.0
        self._lr = 0.0
        self._clip_wait = 0.0
        self._deliveries: dict[str, list[float]] = defaultdict(list)

    # -- one step ---------------------------------------------------------------------------------

    def run_step(self, step: int) -> StepStats:
        """Execute the whole program once (one optimizer step) and return its measurements."""
        self._reset()
        streamer = self.stage.streamer
        if streamer is not None:
            streamer.begin_step()
        self._lr = self.scheduler.get_last_lr()[0] if self.scheduler is not None else self.train.lr
        start = time.perf_counter()
        self._step_inputs(step)  # waiting for data is not compute: timed on its own
        data_wait = time.perf_counter() - start
        times, cpu = run_program(self.program, lambda a: self._handlers[a.op](step, a.mb), self.stage.index, step,
                                 self.stage.device.type == "cpu", self.action_observers)
        times["data_wait"] = data_wait
        wall = time.perf_counter() - start
        times["clip_wait"] = self._clip_wait  # inside STEP, but waiting for the other stages
        leftover = len(self._inputs) + len(self._outputs) + len(self._grads) + len(self._mb_positions)
        if leftover:
            raise RuntimeError(f"stage {self.stage.index}: program left {leftover} tensors unconsumed (bad program)")
        self.steps_done = step + 1
        return StepStats(
            step=step,
            loss_sum=self._loss_sum if self.stage.is_last else None,
            num_label_tokens=self._num_label_tokens,
            grad_sumsq=self._grad_sumsq,
            lr=self._lr,
            busy_s=sum(times[op] for op in COMPUTE_OPS) - self._clip_wait,
            wall_s=wall,
            op_time_s=dict(times),
            op_cpu_s=dict(cpu),
            link_s={kind: statistics.median(v) for kind, v in self._deliveries.items() if v},
            telemetry=sample_telemetry(self.telemetry),  # after the step's timings: not part of them
            streamed_bytes=None if streamer is None else streamer.stats.streamed_bytes,
            frozen_resident_peak_bytes=None if streamer is None else streamer.stats.frozen_resident_peak_bytes,
        )

    # -- handlers ---------------------------------------------------------------------------------

    def _sync(self) -> None:
        # Asynchronous GPU kernels would be timed by whichever action syncs next; keep busy time honest.
        if self.stage.device.type == "cuda":
            torch.cuda.synchronize(self.stage.device)

    def _timed_recv(self, kind: str, step: int, mb: int, sender: str | None) -> Any:
        """Receive an act or grad; when it was sent after this stage began waiting, note how long it took from
        the sender's hand-off to here (encode, link, decode; on one clock across hosts only up to their offset,
        which averaging the two directions of a link cancels: runtime/run/run_profile.py)."""
        waiting = time.time()
        msg = self.wire.recv(kind, step=step, mb=mb, sender=sender, chunk=self.chunk)
        sent = record_of(msg, Act if kind == "act" else Grad).sent
        if isinstance(sent, float) and sent >= waiting:
            self._deliveries[kind].append(time.time() - sent)
        return msg

    def _recv_activation(self, step: int, mb: int) -> None:
        msg = self._timed_recv("act", step, mb, self.prev)
        # cast: a bf16 peer can feed fp16; compressed parts are decoded on this stage's device
        x = _unpack(msg.tensors, "h", self.link_in, self.hidden, self.stage.device).to(self.stage.device,
                                                                                       self.stage.dtype)
        self._inputs[mb] = x.requires_grad_(True)
        if "pos" in msg.tensors:
            self._mb_positions[mb] = msg.tensors["pos"]

    def _step_inputs(self, step: int) -> None:
        """Stage 0 needs the step's input ids, the last stage its labels: both come from the coordinator."""
        if self.stage.is_first and self._input_ids is None:
            msg = self.wire.recv("batch", step=step, sender=COORDINATOR)
            self._input_ids = msg.tensors["input_ids"]
            self._positions = msg.tensors.get("position_ids")
        if self.stage.is_last and self._labels is None:
            msg = self.wire.recv("labels", step=step, sender=COORDINATOR)
            self._labels = msg.tensors["labels"]
            self._num_label_tokens = record_of(msg, Labels).num_label_tokens
            if self._num_label_tokens < 1:
                raise WireError(f"step {step}: coordinator sent num_label_tokens={self._num_label_tokens}")

    def _forward(self, step: int, mb: int) -> None:
        if self.stage.is_first:
            assert self._input_ids is not None
            x = self._input_ids[mb].to(self.stage.device)
            self._inputs[mb] = x
            if self._positions is not None:
                self._mb_positions[mb] = self._positions[mb]
        else:
            x = self._inputs[mb]
        positions = self._mb_positions.pop(mb, None) if self.stage.is_last else self._mb_positions.get(mb)
        out = self.stage.forward(x, positions, logits=False)
        if self.stage.is_last:
            assert self._labels is not None
            # HF causal-LM convention (position t predicts token t+1), fp32 loss whatever the stage dtype, computed
            # in chunks of label tokens: never a whole [tokens, vocab] logits tensor (runtime/stage/loss.py).
            loss_sum = chunked_loss_sum(self.stage.logits, out, self._labels[mb],
                                        int(self.stage.model.config.vocab_size), self.stage.frozen_head)
            self._loss_sum += float(loss_sum.detach())
            out = loss_sum
        self._outputs[mb] = out
        self._sync()

    def _send_activation(self, step: int, mb: int) -> None:
        out = self._outputs[mb].detach()
        _check_finite(out, "activations", self.stage.index, step, mb)
        tensors = compress.pack(out, "h", self.link_out)
        positions = self._mb_positions.pop(mb, None)
        if positions is not None:
            tensors["pos"] = positions
        self.wire.send(self.next, Act(sent=time.time(), chunk=self.next_chunk), step=step, mb=mb, tensors=tensors)

    def _recv_grad(self, step: int, mb: int) -> None:
        msg = self._timed_recv("grad", step, mb, self.next)
        out = self._outputs[mb]
        self._grads[mb] = _unpack(msg.tensors, "g", self.link_out, self.hidden, out.device).to(out.device, out.dtype)

    def _backward(self, step: int, mb: int) -> None:
        out = self._outputs.pop(mb)
        if self.stage.is_last:
            assert self._num_label_tokens is not None
            if out.requires_grad:
                (out / self._num_label_tokens).backward()
        else:
            grad = self._grads.pop(mb)
            if out.requires_grad:
                out.backward(grad)
        if self.stage.is_first:
            self._inputs.pop(mb, None)  # input ids need no gradient
        self._sync()

    def _send_grad(self, step: int, mb: int) -> None:
        x = self._inputs.pop(mb)
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        _check_finite(grad, "input gradients", self.stage.index, step, mb)
        self.wire.send(self.prev, Grad(sent=time.time(), chunk=self.prev_chunk), step=step, mb=mb,
                       tensors=compress.pack(grad, "g", self.link_in))

    def _optimizer_step(self, step: int, mb: int) -> None:
        if self.replicated:
            coef = self._reduce_grads(step)
        else:
            self._grad_sumsq = grad_sumsq(self.params)
            coef, self._clip_wait = clip_round_trip(self.wire, self._grad_sumsq, step, self.stage.index)
        apply_step(self.params, self.optimizer, self.scheduler, coef)
        self._sync()

    def _reduce_grads(self, step: int) -> float:
        """Replicas: send this stage's LoRA gradients (float32) to the coordinator, which sums them with
        the other replicas' for the same keys and answers with the sums and the global clip
        coefficient; the sums replace this stage's gradients. Returns the coefficient."""
        grads = {key: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", accumulate_dtype(p.dtype))
                 for key, p in zip(self.keys, self.params, strict=True)}  # float32 (float64 in a float64 plan)
        self.wire.send(COORDINATOR, "grads", step=step, tensors=grads)
        t0 = time.perf_counter()
        msg = self.wire.recv("reduced", step=step, sender=COORDINATOR)
        self._clip_wait = time.perf_counter() - t0
        if set(msg.tensors) != set(self.keys):
            raise WireError(f"step {step}: the coordinator's summed gradients name other tensors than stage "
                            f"{self.stage.index}'s LoRA parameters")
        with torch.no_grad():
            for key, p in zip(self.keys, self.params, strict=True):
                total = msg.tensors[key]
                if tuple(total.shape) != tuple(p.shape):
                    raise WireError(f"step {step}: summed gradient {key} has shape {tuple(total.shape)}, "
                                    f"the parameter {tuple(p.shape)}")
                p.grad = total.to(p.device, p.dtype).clone()
        self._grad_sumsq = grad_sumsq(self.params)
        return float(record_of(msg, Reduced).coef)


DIVERGED_HINT = "training diverged; lower train.lr (or raise train.warmup_steps) and resume from the last checkpoint"


def run_program(program: list[Action], run: Callable[[Action], None], index: int, step: int, on_cpu: bool,
                observers: list[Callable[[int, str, int, int, float, float], None]],
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Run each action of one step's program; the seconds spent per op (wall, and on a CPU stage process CPU)."""
    times: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    for action in program:
        t0, c0 = time.perf_counter(), time.process_time() if on_cpu else 0.0
        run(action)
        t1 = time.perf_counter()
        times[action.op] += t1 - t0
        if on_cpu and action.op in CPU_TIMED_OPS:
            cpu[action.op] += time.process_time() - c0
        for observe in observers:
            observe(index, action.op, step, action.mb, t0, t1)
    return times, cpu


def clip_round_trip(wire: Wire, sumsq: float, step: int, index: int) -> tuple[float, float]:
    """Send this process's squared LoRA gradient norm, wait for the coordinator's clip coefficient; (coefficient,
    seconds waited)."""
    if not math.isfinite(sumsq):  # the record would refuse it, without the hint
        raise TrainingDivergedError(f"stage {index} computed NaN/inf LoRA gradients at step {step + 1}: {DIVERGED_HINT}")
    wire.send(COORDINATOR, GradNorm(sumsq=sumsq), step=step)
    t0 = time.perf_counter()
    msg = wire.recv("clip", step=step, sender=COORDINATOR)
    return float(record_of(msg, Clip).coef), time.perf_counter() - t0


def _check_finite(t: torch.Tensor, what: str, k: int, step: int, mb: int) -> None:
    """Peers drop non-finite activations and gradients (runtime/wire/rules.py): fail here, by name, instead."""
    if not bool(torch.isfinite(t).all()):
        raise TrainingDivergedError(f"stage {k} computed NaN/inf {what} at step {step + 1}, micro-batch {mb}: "
                                    f"{DIVERGED_HINT}")


def _unpack(tensors: dict[str, torch.Tensor], name: str, scheme: str, hidden: int,
            device: torch.device) -> torch.Tensor:
    """What compress.pack sent: the tensor; compressed, its parts copied to ``device`` (the compressed bytes cross the
    host link, not the decoded ones) and decoded there in float32 (the caller casts to its dtype)."""
    if scheme == "none":
        return tensors[name]
    parts = {part: t.to(device) for part, t in compress.parts_of(tensors, name, scheme).items()}
    return compress.decode(parts, scheme, hidden, torch.float32)


def _peer(stage: int | str) -> str:
    """A neighbour's process name: given, or stage<k> for an index."""
    return stage if isinstance(stage, str) else stage_name(stage)
