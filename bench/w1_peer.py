"""W1's peer: torch.distributed.pipelining with manual stages (even split, remainder to the front),
Schedule1F1B over gloo, one process x 1 thread per stage, stock peft LoRA; and the check that its
stage modules chained compute what the whole model does.

The W1 sizes are read as ``w1_model.NAME`` when called: W3 resizes the model before it runs the peer.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import w1_model as w1


class FrontStage(torch.nn.Module):
    """Embedding + the first decoder layers of a (peft-wrapped) Llama."""

    def __init__(self, llama: Any, layers: range) -> None:
        super().__init__()
        self.embed = llama.model.embed_tokens
        self.layers = torch.nn.ModuleList(llama.model.layers[i] for i in layers)
        self.rotary = llama.model.rotary_emb

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.run_layers(self.embed(input_ids))

    def run_layers(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
        rope = self.rotary(hidden, position_ids=position_ids)
        for layer in self.layers:  # attention_mask None: sdpa runs causal, as the full model does
            hidden = layer(hidden, position_embeddings=rope, position_ids=position_ids)
        return hidden


class MiddleStage(FrontStage):
    """Decoder layers only."""

    def __init__(self, llama: Any, layers: range) -> None:
        super().__init__(llama, layers)
        del self.embed

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.run_layers(hidden)


class BackStage(MiddleStage):
    """The last decoder layers + final norm + LM head."""

    def __init__(self, llama: Any, layers: range) -> None:
        super().__init__(llama, layers)
        self.norm = llama.model.norm
        self.head = llama.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.head(self.norm(self.run_layers(hidden)))


def even_counts(stages: int) -> list[int]:
    """The split a user of the peer writes by hand: decoder layers evenly, the remainder to the front."""
    base, rest = divmod(w1.W1_ARCH["num_hidden_layers"], stages)
    return [base + (1 if k < rest else 0) for k in range(stages)]


def split_stages(model: torch.nn.Module, counts: list[int] | None = None) -> list[torch.nn.Module]:
    """The peer's stage modules over ``counts`` decoder layers each (default: two equal halves)."""
    llama = model.base_model.model
    counts = counts or even_counts(2)
    mods: list[torch.nn.Module] = []
    start = 0
    for k, c in enumerate(counts):
        span = range(start, start + c)
        cls = FrontStage if k == 0 else BackStage if k == len(counts) - 1 else MiddleStage
        mods.append(cls(llama, span))
        start += c
    return mods


def pipelining_worker(rank: int, port: int, model_dir: str, data: str, steps: int, out: str,
                      counts: list[int] | None = None, num_micro: int | None = None,
                      addr: str = "127.0.0.1", stage_cls: Any = None, schedule_cls: Any = None) -> None:
    """One rank of the peer: ``steps`` steps of its stage; rank 0 writes the per-step seconds to ``out``.

    ``stage_cls`` / ``schedule_cls``: subclasses of PipelineStage / Schedule1F1B to run instead (W3 times
    their chunks and marks each step through them)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_cls, schedule_cls = stage_cls or PipelineStage, schedule_cls or Schedule1F1B
    counts = counts or even_counts(2)
    world = len(counts)
    num_micro = num_micro or w1.NUM_MICRO
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = w1.peft_model(Path(model_dir))
    module = split_stages(model, counts)[rank]
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=w1.LR)
    batches = w1.step_batches(Path(model_dir), Path(data), num_micro)
    stage = stage_cls(module, rank, world, torch.device("cpu"))
    divisor = {"n": 1}

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return w1.token_loss_sum(logits, labels) / divisor["n"]

    # Our loss is already divided by the step's label tokens: no extra 1/M scaling.
    schedule = schedule_cls(stage, n_microbatches=num_micro, loss_fn=loss_fn, scale_grads=False)
    times = []
    for i in range(steps):
        batch = batches.step(i)
        divisor["n"] = batch.num_label_tokens
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(batch.input_ids.reshape(-1, w1.SEQ_LEN))
        elif rank == world - 1:
            schedule.step(target=batch.labels.reshape(-1, w1.SEQ_LEN))
        else:
            schedule.step()
        # Global-norm clipping across all stages, as one device would clip.
        sq = torch.stack([p.grad.pow(2).sum() for p in params if p.grad is not None]).sum()
        dist.all_reduce(sq)
        coef = min(1.0, 1.0 / (float(sq.sqrt()) + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def run_pipelining(model_dir: Path, data: Path, steps: int, work: Path, counts: list[int] | None = None,
                   num_micro: int | None = None) -> list[float]:
    """torch.distributed.pipelining with Schedule1F1B over gloo, one process x 1 thread per stage."""
    import torch.multiprocessing as mp

    counts = counts or even_counts(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "pipelining.json"
    out.unlink(missing_ok=True)
    mp.start_processes(pipelining_worker, args=(port, str(model_dir), str(data), steps, str(out), counts,
                                                 num_micro), nprocs=len(counts), join=True, start_method="spawn")
    return json.loads(out.read_text())


def check_split(model_dir: Path, counts: list[int] | None = None) -> float:
    """Max |logits| difference between the peer's stage modules chained and the whole model."""
    model = w1.peft_model(model_dir).eval()
    ids = torch.randint(3, w1.W1_ARCH["vocab_size"], (2, w1.SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = ids
        for mod in split_stages(model, counts):
            h = mod(h)
        return float((h - model(input_ids=ids).logits).abs().max())
