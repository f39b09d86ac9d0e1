"""One process of `--engine torch`: plan stage k as a torch.distributed.pipelining PipelineStage.

The ranks go host by host (``rank_order``); the (dp, pp) DeviceMesh of R replicas x S stages is written out
from the plan, so position p of replica r is the plan's stage ``plan.pipelines[r].stages[p]`` wherever it
runs. Each step:

- replica r's first stage feeds its share of the step's micro-batches to the schedule, its last stage the
  labels; the loss of a micro-batch is its summed token cross-entropy over the *whole step's* label tokens
  (every replica's too), as hetero's engine computes it, so the accumulated gradient is the one-GPU one;
- the LoRA gradients are summed over the replicas (all-reduce on the mesh's dp dimension), the global norm
  is summed over the stages (pp dimension), and every stage clips by it and steps AdamW and the schedule;
- global rank 0 reads the data and broadcasts each step's batch, writes metrics.jsonl and, when due, gathers
  the stages' state (as safetensors bytes, never serialized Python objects: transfer.py) into hetero's
  checkpoint and adapter. Only rank 0's host needs the data and the run directory.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetero.plan import Plan
from hetero.planner.schedule.step_form import step_form
from hetero.runtime.run.data import IGNORE_INDEX
from hetero.runtime.torch_engine.transfer import broadcast_batch

log = logging.getLogger("hetero.torch_engine")


class StageModule(nn.Module):
    """A built hetero stage as the module PipelineStage runs: its forward is the stage's (layers, recomputation).

    Detour: PipelineStage takes an nn.Module; hetero's Stage is a plain object around one, so this holds the
    Stage's model (and LoRA wrapper) as children, so that their parameters are the module's."""

    def __init__(self, stage: Any) -> None:
        super().__init__()
        self.stage = stage
        self.body = stage.lora_model if stage.lora_model is not None else stage.model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage.forward(x)


@dataclass
class Rank:
    """Where this process sits: its plan stage, its replica and position, and the mesh's process groups."""

    plan: Plan
    rank: int
    replica: int
    position: int
    k: int  # the plan's stage index
    pp: Any  # the process group of this replica's stages
    dp: Any  # the process group of this stage position's replicas (None: one replica)

    @property
    def first(self) -> bool:
        return self.position == 0

    @property
    def last(self) -> bool:
        return self.position == len(self.plan.pipelines[0].stages) - 1


def rank_order(plan: Plan) -> list[int]:
    """The plan stage of each global rank: host by host (the hosts in the order of their first stage), each
    host's stages in plan order. torch's launcher numbers one node's ranks contiguously, node after node."""
    hosts = list(dict.fromkeys(s.host for s in plan.stages))
    return [s.index for host in hosts for s in plan.stages if s.host == host]


def node_hosts(plan: Plan) -> list[str]:
    """The hosts in node-rank order (node 0, the host of stage 0, keeps the rendezvous and rank 0)."""
    return list(dict.fromkeys(s.host for s in plan.stages))


def place(plan: Plan, backend: str, timeout_s: float) -> Rank:
    """Join the process group and the (dp, pp) DeviceMesh; where this rank sits in the plan (with rank 0's
    training settings).

    ``timeout_s`` bounds every wait of a collective or a transfer (runtime.step_timeout_s): a stage that never
    answers ends the run with an error instead of a hang. The mesh is written out rank by rank: a replica's
    stages need not have consecutive ranks (two replicas whose first stages share one host)."""
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

    from hetero.runtime.torch_engine.transfer import shared_settings

    # With NCCL, gloo still serves the CPU tensors hetero exchanges (batches, settings, norms, stage state).
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
                            timeout=timedelta(seconds=timeout_s))
    plan = shared_settings(plan)
    rank = dist.get_rank()
    order = rank_order(plan)
    rank_of = {k: r for r, k in enumerate(order)}
    grid = torch.tensor([[rank_of[k] for k in rep.stages] for rep in plan.pipelines], dtype=torch.int64)
    mesh = DeviceMesh("cpu" if backend == "gloo" else "cuda", grid, mesh_dim_names=("dp", "pp"))
    k = order[rank]
    replica, position = next((r, rep.stages.index(k)) for r, rep in enumerate(plan.pipelines) if k in rep.stages)
    return Rank(plan, rank, replica, position, k, mesh.get_group("pp"),
                mesh.get_group("dp") if len(plan.pipelines) > 1 else None)


def build(where: Rank, device: torch.device) -> tuple[Any, Any]:
    """Stage k built as hetero builds it, its optimizer (an Executor without a wire) and its PipelineStage."""
    from torch.distributed.pipelining import PipelineStage

    from hetero.runtime.stage.executor import Executor
    from hetero.runtime.stage.model import build_stage

    plan = where.plan
    stage = build_stage(plan, where.k, device)
    executor = Executor(stage, [], None, plan.train, replicated=len(plan.pipelines) > 1)  # type: ignore[arg-type]
    module = StageModule(stage)
    mb, seq = plan.train.micro_batch_size, plan.model.seq_len
    hidden = int(plan.model.architecture["hidden_size"])
    vocab = int(plan.model.architecture["vocab_size"])
    # Example inputs and outputs on the meta device: without them PipelineStage infers shapes at the first step by
    # sending serialized Python objects between ranks; with them only tensors cross.
    meta = torch.device("meta")
    # Activations and outputs carry gradients (PipelineStage takes requires_grad from the examples).
    x = (torch.empty(mb, seq, dtype=torch.long, device=meta) if where.first
         else torch.empty(mb, seq, hidden, dtype=stage.dtype, device=meta, requires_grad=True))
    y = torch.empty(mb, seq, vocab if where.last else hidden, dtype=stage.dtype, device=meta, requires_grad=True)
    pipe = PipelineStage(module, where.position, len(plan.pipelines[0].stages), device, input_args=(x,),
                         output_args=(y,), group=where.pp)
    # torch takes position p for rank p of the pp group, whose ranks follow the global ones: not so when a pipeline
    # comes back to an earlier host (hosts a, b, a: global ranks 0, 2, 1). Each position's group rank, from the plan.
    order = rank_order(plan)
    pipe.stage_index_to_group_rank = {p: dist.get_group_rank(where.pp, order.index(k))
                                      for p, k in enumerate(plan.pipelines[where.replica].stages)}
    return executor, pipe


def time_ops(pipe: Any, ops: dict[str, float]) -> None:
    """Add each forward and backward of ``pipe`` to ``ops["F"]`` / ``ops["B"]`` (the stage_ops of metrics.jsonl).

    Detour: torch's schedules expose no per-action timing; these two PipelineStage methods are where its
    schedules compute a micro-batch (receives and sends are separate operations), so they are wrapped."""
    for name, op in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
        method = getattr(pipe, name)

        def timed(*args: Any, _method: Any = method, _op: str = op, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                ops[_op] += time.perf_counter() - t0

        setattr(pipe, name, timed)


@dataclass
class StepLoss:
    """The loss function the schedule calls per micro-batch, and what it summed this step."""

    num_label_tokens: int = 1
    total: float = 0.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # HF causal-LM convention, fp32 loss, divided by the whole step's label tokens (executor._forward/_backward).
        shifted = logits[:, :-1].float()
        loss_sum = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        self.total += float(loss_sum.detach())
        return loss_sum / self.num_label_tokens


def make_schedule(plan: Plan, replica: int, pipe: Any, loss: StepLoss) -> Any:
    from torch.distributed import pipelining

    cls = getattr(pipelining, step_form(plan.train.schedule).torch_class)
    # scale_grads=False: the loss is already over the step's label tokens (torch would divide by the micro-batches).
    return cls(pipe, n_microbatches=plan.pipelines[replica].num_micro_batches, loss_fn=loss, scale_grads=False)


def replica_share(plan: Plan, replica: int, tensor: torch.Tensor) -> torch.Tensor:
    """Replica ``replica``'s micro-batches of a step's [M, B, S] tensor, as the [m * B, S] batch a schedule splits."""
    rep = plan.pipelines[replica]
    share = tensor[rep.first_micro_batch:rep.first_micro_batch + rep.num_micro_batches]
    return share.reshape(-1, share.shape[-1]).contiguous()


def run_schedule(where: Rank, schedule: Any, loss: StepLoss, batch: Any, device: torch.device) -> None:
    """One step's forward and backward passes of this stage under the plan's schedule."""
    loss.total = 0.0
    if batch is not None:
        loss.num_label_tokens = int(batch.num_label_tokens)
    args = (replica_share(where.plan, where.replica, batch.input_ids).to(device),) if where.first else ()
    target = replica_share(where.plan, where.replica, batch.labels).to(device) if where.last else None
    if where.last:
        schedule.step(*args, target=target, losses=[])
    else:
        schedule.step(*args)


def clip_and_step(where: Rank, executor: Any) -> tuple[float, float, float]:
    """Sum LoRA gradients over replicas, clip by the global norm (summed over stages), step; (norm, coef, lr)."""
    from hetero.runtime.run.reduce import clip_coef
    from hetero.runtime.stage.executor import apply_step, grad_sumsq

    params = executor.params
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if where.dp is not None and params:  # one all-reduce of every LoRA gradient, not one per tensor
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=where.dp)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
    sumsq = torch.tensor([grad_sumsq(params)], dtype=torch.float64)
    dist.all_reduce(sumsq, group=where.pp)
    grad_norm = math.sqrt(float(sumsq))
    coef = clip_coef(where.plan.train.max_grad_norm, grad_norm)
    lr = float(executor.scheduler.get_last_lr()[0]) if executor.scheduler is not None else 0.0
    apply_step(params, executor.optimizer, executor.scheduler, coef)
    executor.steps_done += 1
    return grad_norm, coef, lr


def step_totals(where: Rank, loss: StepLoss, lr: float, ops: dict[str, float]) -> tuple[float, float, list[dict[str, float]]]:
    """(loss of the step, the lr, each stage's F/B/STEP seconds) as every rank knows them after an all-reduce."""
    n = len(where.plan.stages)
    values = torch.zeros(2 + 3 * n, dtype=torch.float64)
    if where.last:
        values[0] = loss.total
    if where.k == where.plan.pipelines[0].stages[0]:
        values[1] = lr
    values[2 + 3 * where.k: 5 + 3 * where.k] = torch.tensor([ops["F"], ops["B"], ops["STEP"]], dtype=torch.float64)
    dist.all_reduce(values)
    per_stage = values[2:].view(n, 3).tolist()
    return float(values[0]), float(values[1]), [{"F": f, "B": b, "STEP": st} for f, b, st in per_stage]


def gather_state(where: Rank, executor: Any) -> dict[int, Any] | None:
    """The first replica's stage payloads on rank 0 (None elsewhere), sent as bytes (ranks share no disk)."""
    from hetero.runtime.stage.state import stage_payload
    from hetero.runtime.torch_engine.transfer import pack_payload, recv_bytes, send_bytes, unpack_payload

    plan = where.plan
    order = rank_order(plan)
    mine = pack_payload(*stage_payload(executor, plan.input_hash)) if where.replica == 0 else b""
    if where.rank != 0:
        if where.replica == 0:
            send_bytes(mine, 0)
        return None
    payloads = {}
    for k in plan.pipelines[0].stages:
        data = mine if order[0] == k else recv_bytes(order.index(k))
        payloads[k] = Payload(*unpack_payload(data))
    return payloads


@dataclass
class Payload:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def restore(where: Rank, executor: Any, resume: Path | None) -> int:
    """Load this stage's share of a checkpoint (any split, either engine); returns the steps it had done.

    Rank 0 reads the checkpoint (it is on rank 0's host) and sends every other rank its share as bytes: each
    rank first sends the LoRA keys its stage holds."""
    from hetero.runtime.run.checkpoint import load_checkpoint_union, select_payload
    from hetero.runtime.stage.state import restore_stage
    from hetero.runtime.torch_engine.transfer import pack_payload, recv_bytes, send_bytes, unpack_payload

    resuming = torch.tensor([int(resume is not None)])
    dist.broadcast(resuming, 0)  # rank 0's --resume decides (a host elsewhere is not told it)
    if not int(resuming):
        return 0
    order = rank_order(where.plan)
    if where.rank != 0:
        send_bytes(json.dumps(list(executor.keys)).encode(), 0)
        tensors, meta = unpack_payload(recv_bytes(0))
    else:
        union, union_meta = load_checkpoint_union(Path(str(resume)))
        for r in range(1, len(order)):
            keys = json.loads(recv_bytes(r))
            send_bytes(pack_payload(*select_payload(union, union_meta, keys, order[r])), r)
        tensors, meta = select_payload(union, union_meta, list(executor.keys), where.k)
    restore_stage(executor, tensors, meta)
    return int(executor.steps_done)


def metrics(plan: Plan, step: int, values: tuple[float, float, float, float, list[dict[str, float]]],
            label_tokens: int, step_time: float) -> Any:
    """Step ``step``'s metrics.jsonl line (numbered from 1: records.STEP_NUMBERS), with the fields hetero's engine
    writes that this one measures."""
    from hetero.runtime.run.metrics_file import StepLine
    from hetero.runtime.run.records import throughput

    loss_sum, lr, grad_norm, coef, ops = values
    return StepLine(step=step + 1, loss=loss_sum / label_tokens, lr=lr, grad_norm=grad_norm, clip_coef=coef,
                    **throughput(plan, label_tokens, step_time), stage_busy=[sum(o.values()) for o in ops],
                    stage_wall=[step_time] * len(ops), stage_ops=ops, engine="torch")


def train(where: Rank, executor: Any, schedule: Any, loss: StepLoss, device: torch.device, run_dir: Path,
          start: int, progress: bool, ops: dict[str, float]) -> None:
    """Every step from ``start``; rank 0 keeps the records (metrics, checkpoints, adapter)."""
    from hetero.runtime.base.payloads import payload_due
    from hetero.runtime.run.records import ProgressBar, RunRecords

    plan = where.plan
    batches = _batches(plan) if where.rank == 0 else None  # rank 0 reads the data and shares each step's batch
    shape = (plan.train.num_micro_batches, plan.train.micro_batch_size, plan.model.seq_len)
    records = RunRecords(plan, run_dir) if where.rank == 0 else None
    if records is not None:
        records.start_metrics(start)
    with ProgressBar(plan.train.steps, progress and where.rank == 0, first=start) as bar:
        for step in range(start, plan.train.steps):
            t0 = time.perf_counter()
            batch = broadcast_batch(batches.step(step) if batches is not None else None, shape)
            ops.update(F=0.0, B=0.0)
            run_schedule(where, schedule, loss, batch, device)
            t1 = time.perf_counter()
            grad_norm, coef, lr = clip_and_step(where, executor)
            ops["STEP"] = time.perf_counter() - t1
            loss_sum, lr0, stage_ops = step_totals(where, loss, lr, ops)
            step_time = time.perf_counter() - t0
            due = payload_due(plan.train, 0, step)
            payloads = gather_state(where, executor) if due else None
            if records is not None:
                line = metrics(plan, step, (loss_sum, lr0, grad_norm, coef, stage_ops), int(batch.num_label_tokens),
                               step_time)
                records.step(line)
                bar.update(step, line.loss, line.tokens_per_s)
                if payloads is not None:
                    records.save_payloads(step, payloads)


def _batches(plan: Plan) -> Any:
    from hetero.runtime.pretrained import resolve_dir
    from hetero.runtime.run.data import StepBatches

    train = plan.train
    return StepBatches(plan.data, resolve_dir(plan.model), plan.model.seq_len, train.micro_batch_size,
                       train.num_micro_batches, train.seed, train.shuffle, hold_out=plan.eval.split)


def rank_main(plan_path: str, run_dir: str, backend: str, resume: str | None, progress: bool,
              timeout_s: float) -> None:
    """The entry point torch's launcher starts once per stage process."""
    plan = Plan.load(Path(plan_path))
    where = place(plan, backend, timeout_s)
    plan = where.plan
    logging.basicConfig(filename=Path(run_dir) / "logs" / f"stage{where.k}.log", level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, plan.stages[where.k].threads or 1))
    from hetero.runtime.stage.process import device_for

    device = torch.device(device_for(plan, where.k))
    try:
        executor, pipe = build(where, device)
        start = restore(where, executor, Path(resume) if resume else None)
        loss = StepLoss()
        schedule = make_schedule(plan, where.replica, pipe, loss)
        ops = {"F": 0.0, "B": 0.0, "STEP": 0.0}
        time_ops(pipe, ops)
        dist.barrier()
        train(where, executor, schedule, loss, device, Path(run_dir), start, progress, ops)
        dist.barrier()
    except Exception:
        log.exception("stage %d (rank %d) failed", where.k, where.rank)
        raise
    finally:
        dist.destroy_process_group()
