"""W1's baselines and bounds: all micro-batches in one process (stock peft), and the step-time bound at
layer granularity from each graph node's forward + backward time measured alone with hetero's kernels."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from w1_model import (
    LR,
    MICRO_BATCH,
    NUM_MICRO,
    SEQ_LEN,
    W1_ARCH,
    median_tail,
    peft_model,
    step_batches,
    token_loss_sum,
)


def run_one_process(model_dir: Path, data: Path, steps: int, threads: int, num_micro: int | None = None,
                    targets: list[str] | None = None) -> list[float]:
    """All micro-batches in one process with ``threads`` threads (LoRA on ``targets``); returns per-step seconds."""
    torch.set_num_threads(threads)
    model = peft_model(model_dir, targets)
    batches = step_batches(model_dir, data, num_micro)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    times = []
    for i in range(steps):
        batch = batches.step(i)
        start = time.perf_counter()
        for ids, labels in zip(batch.input_ids, batch.labels, strict=True):
            (token_loss_sum(model(input_ids=ids).logits, labels) / batch.num_label_tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def node_times(model_dir: Path, reps: int = 6) -> tuple[list[float], float]:
    """Forward + backward seconds per micro-batch of each layer-graph node (embedding, each decoder
    layer, norm + head + loss), measured alone in this process with 1 thread and hetero's LoRA kernels
    (runtime/stage/lora.py), median of ``reps``; and the optimizer step (global clip + AdamW) over all LoRA."""
    from hetero.runtime.stage.lora import share_lora_inputs

    torch.set_num_threads(1)
    model = peft_model(model_dir)
    share_lora_inputs(model)
    llama = model.base_model.model
    inner = llama.model
    ids = torch.randint(3, W1_ARCH["vocab_size"], (MICRO_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ_LEN).unsqueeze(0)

    def timed(fn: Any) -> float:
        samples = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples[1:])

    with torch.no_grad():
        hidden = inner.embed_tokens(ids)
        rope = inner.rotary_emb(hidden, position_ids)

    def embed() -> None:
        with torch.no_grad():  # stage 0's input needs no gradient, and the embedding has no LoRA
            inner.rotary_emb(inner.embed_tokens(ids), position_ids)

    def layer_fn(layer: Any) -> Any:
        def run() -> None:
            h = hidden.clone().requires_grad_(True)
            out = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
            (out[0] if isinstance(out, tuple) else out).backward(torch.ones_like(h))
        return run

    def tail() -> None:
        h = hidden.clone().requires_grad_(True)
        (token_loss_sum(llama.lm_head(inner.norm(h)), ids) / ids.numel()).backward()

    times = [timed(embed)] + [timed(layer_fn(layer)) for layer in inner.layers] + [timed(tail)]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)

    def opt() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return times, timed(opt)


def layer_bound(node_s: list[float], opt_s: float, stages: int, num_micro: int, cores: int) -> tuple[float, list[int]]:
    """Step-time bound at layer granularity and the decoder layers per stage of the split that gives it.

    The embedding goes with the first stage and norm + head with the last (as every runtime here
    splits); the best contiguous split minimises the slowest stage; 1F1B then needs (m + S - 1) of
    its micro-batch slots, plus its share of the optimizer step. With more stages than cores the
    cores cannot all run at once: the step is also at least all work / cores."""
    layers = node_s[1:-1]
    n = len(layers)
    best: tuple[float, list[int]] | None = None

    def splits(left: int, parts: int) -> Any:
        if parts == 1:
            yield [left]
            return
        for first in range(1, left - parts + 2):
            for rest in splits(left - first, parts - 1):
                yield [first, *rest]

    for counts in splits(n, stages):
        bounds, start = [], 0
        for k, c in enumerate(counts):
            t = sum(layers[start:start + c]) + (node_s[0] if k == 0 else 0.0) + (node_s[-1] if k == stages - 1 else 0.0)
            bounds.append(t)
            start += c
        slowest = max(bounds)
        if best is None or slowest < best[0]:
            best = (slowest, counts)
    assert best is not None
    slowest, counts = best
    pipeline = slowest * (num_micro + stages - 1) + opt_s * max(counts) / n
    work = sum(node_s) * num_micro + opt_s
    return max(pipeline, work / min(cores, stages)), counts


def _one_process_worker(model_dir: str, data: str, steps: int, threads: int, out: str,
                        targets: list[str] | None) -> None:
    Path(out).write_text(json.dumps(run_one_process(Path(model_dir), Path(data), steps, threads, NUM_MICRO, targets)))


def one_process_in_child(model_dir: Path, data: Path, steps: int, threads: int, work: Path,
                         targets: list[str] | None = None) -> float:
    """run_one_process in a spawned process (its threads and allocations leave this one untouched)."""
    import multiprocessing as mp

    out = work / f"one-process-{threads}t.json"
    proc = mp.get_context("spawn").Process(target=_one_process_worker,
                                           args=(str(model_dir), str(data), steps, threads, str(out), targets))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"one-process baseline ({threads} threads) exited with {proc.exitcode}")
    return median_tail(json.loads(out.read_text()))
