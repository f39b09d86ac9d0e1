"""Workload W1 (/work/shared/BENCHMARKS.md): the hetero runtime against its peer and baselines on this CPU.

    python bench/bench_runtime.py                          # 2 and 3 stages x 4, 8, 16 micro-batches, ~8 min
    python bench/bench_runtime.py --stages 2 --micro-batches 8 --rounds 3

Model: random-init Llama (hidden 256, 8 layers, 8 heads, 4 KV heads, intermediate 688, vocab 2048,
untied head), seq 128, fp32, sdpa; LoRA r=8 alpha 16 on q,k,v,o,gate,up,down; AdamW lr 1e-3;
micro-batches of 4 sequences (m = 8: 4096 tokens per step). Every run trains the same model on the
same token stream, measured in this one script run:

  one-process-1t    all micro-batches in one process (stock peft), 1 thread
  one-process-2t    the same with 2 threads (the best one device can do here)
  torch-pipelining  the peer: torch.distributed.pipelining, manual stages (even split, remainder to
                    the front), Schedule1F1B, gloo, S processes x 1 thread, stock peft LoRA
  hetero            `hetero compile` + `hetero run` (S CPU stages x 1 thread over ZeroMQ loopback)

hetero and the peer run alternately (``--rounds`` pairs per setting, the first of each pair
swapped every round), so a drifting machine slows both alike; a setting's figure is the median
over its rounds of each run's median step time over steps 3..N. Bounds: the classic balanced bound
(one-process-1t / S x (m+S-1)/m) and the honest one at layer granularity (per-node forward+backward
times measured alone with hetero's kernels, the best contiguous split's slowest stage x (m+S-1),
plus the optimizer step); with more stages than cores the bound is also at least the total work
divided by the cores. hetero's own metrics (stage_ops) say where each stage's step goes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

W1_ARCH: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
SEQ_LEN, MICRO_BATCH, NUM_MICRO = 128, 4, 8
LR = 1e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS_PER_STEP = SEQ_LEN * MICRO_BATCH * NUM_MICRO
REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- setup: model dir + token data


def prepare(work: Path, steps: int, num_micro: int | None = None) -> tuple[Path, Path]:
    """Save the W1 model (seed 0) with a tokenizer, and a tokens-format data file with enough rows for
    ``steps`` steps of ``num_micro`` (default NUM_MICRO) micro-batches; return both paths."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hetero.pretrained import build_tokenizer

    model_dir = work / "w1-model"
    arch = dict(W1_ARCH)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(str(model_dir))
    # Only the pad id matters for pre-tokenized data; the demo data cannot fill a 2048-token BPE.
    build_tokenizer(dict(W1_ARCH, vocab_size=512), model_dir)
    rng = random.Random(0)
    data = work / "w1-tokens.jsonl"
    with data.open("w") as f:
        for _ in range(steps * MICRO_BATCH * (num_micro or NUM_MICRO)):
            f.write(json.dumps({"input_ids": [rng.randrange(3, W1_ARCH["vocab_size"]) for _ in range(SEQ_LEN)]}) + "\n")
    return model_dir, data


def step_batches(model_dir: Path, data: Path, num_micro: int | None = None) -> Any:
    """The StepBatches every baseline reads (the hetero run reads the same file the same way)."""
    from hetero.runtime.run.data import StepBatches
    from hetero.specs import DataSpec

    return StepBatches(DataSpec(path=str(data), format="tokens"), model_dir, SEQ_LEN, MICRO_BATCH,
                       num_micro or NUM_MICRO, seed=0, shuffle=True)


def peft_model(model_dir: Path) -> torch.nn.Module:
    """The fp32 W1 model with fresh LoRA (seed 0), in training mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(base, config).train()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (HF shift convention)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


# ---------------------------------------------------------------- baseline: one process


def run_one_process(model_dir: Path, data: Path, steps: int, threads: int, num_micro: int | None = None) -> list[float]:
    """All micro-batches in one process with ``threads`` threads; returns per-step seconds."""
    torch.set_num_threads(threads)
    model = peft_model(model_dir)
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


# ---------------------------------------------------------------- the honest bound: per-node times


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


# ---------------------------------------------------------------- baseline: torch.distributed.pipelining


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
    base, rest = divmod(W1_ARCH["num_hidden_layers"], stages)
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


def _pipelining_worker(rank: int, port: int, model_dir: str, data: str, steps: int, out: str,
                       counts: list[int] | None = None, num_micro: int | None = None,
                       addr: str = "127.0.0.1") -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    counts = counts or even_counts(2)
    world = len(counts)
    num_micro = num_micro or NUM_MICRO
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = peft_model(Path(model_dir))
    module = split_stages(model, counts)[rank]
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    batches = step_batches(Path(model_dir), Path(data), num_micro)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    divisor = {"n": 1}

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) / divisor["n"]

    # Our loss is already divided by the step's label tokens: no extra 1/M scaling.
    schedule = Schedule1F1B(stage, n_microbatches=num_micro, loss_fn=loss_fn, scale_grads=False)
    times = []
    for i in range(steps):
        batch = batches.step(i)
        divisor["n"] = batch.num_label_tokens
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(batch.input_ids.reshape(-1, SEQ_LEN))
        elif rank == world - 1:
            schedule.step(target=batch.labels.reshape(-1, SEQ_LEN))
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
    mp.start_processes(_pipelining_worker, args=(port, str(model_dir), str(data), steps, str(out), counts,
                                                 num_micro), nprocs=len(counts), join=True, start_method="spawn")
    return json.loads(out.read_text())


def check_split(model_dir: Path, counts: list[int] | None = None) -> float:
    """Max |logits| difference between the peer's stage modules chained and the whole model."""
    model = peft_model(model_dir).eval()
    ids = torch.randint(3, W1_ARCH["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = ids
        for mod in split_stages(model, counts):
            h = mod(h)
        return float((h - model(input_ids=ids).logits).abs().max())


# ---------------------------------------------------------------- hetero itself


HARDWARE_YAML = """\
name: w1
hosts:
  - name: localhost
    address: 127.0.0.1
    port: {port}
    devices:
      - {{type: cpu, count: {count}, threads: 1}}
"""


# Runs a command and prints the largest peak RSS (KiB) of any process it waited for (stage workers included).
_PEAK_RSS = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
             "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(rc)")


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now (a run binds base-1..base+S)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            for p in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _hetero_cmd() -> list[str]:
    return [sys.executable, "-m", "hetero.cli"] if not shutil.which("hetero") else ["hetero"]


def compile_hetero(model_dir: Path, data: Path, steps: int, work: Path, extra: tuple[str, ...] = (),
                   stages: int = 2, num_micro: int | None = None, name: str = "plan") -> tuple[Path | None, str]:
    """`hetero compile` of W1 on ``stages`` local CPU devices; returns (plan.json, note)."""
    conf = work / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    port = free_ports(max(2, stages) + 1) + 1  # the coordinator takes base port - 1
    (conf / "hardware" / "w1.yaml").write_text(HARDWARE_YAML.format(port=port, count=max(2, stages)))
    out = work / name
    cmd = _hetero_cmd() + [
        "compile", "-cd", str(conf), "model=hf", f"model.pretrained={model_dir}", f"model.seq_len={SEQ_LEN}",
        "model.dtype=float32", "lora.r=8", "lora.alpha=16", "hardware=w1", f"train.micro_batch_size={MICRO_BATCH}",
        f"train.num_micro_batches={num_micro or NUM_MICRO}", f"train.steps={steps}", f"train.lr={LR}",
        "train.schedule=1f1b", f"data.path={data}", "data.format=tokens", f"planner.num_stages={stages}",
        f"output={out}", *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=1800)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"`hetero compile` failed: {lines[-1] if lines else proc.returncode}"
    return out / "plan.json", f"plan {out / 'plan.json'}"


def run_plan(plan: Path, steps: int, work: Path, peak: dict[str, float] | None = None,
             detail: dict[str, Any] | None = None) -> tuple[list[float] | None, str]:
    """`hetero run plan.json`; returns (per-step seconds, note). ``peak``: filled with the largest process
    peak RSS (MiB); ``detail``: with the median per-op seconds of each stage over steps 3..N."""
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = _hetero_cmd() + ["run", str(plan), "--run-dir", str(run_dir), "--no-progress"]
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS, *cmd], capture_output=True, text=True, cwd=work,
                          timeout=1800)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"`hetero run` failed: {lines[-1] if lines else proc.returncode}"
    for line in proc.stderr.splitlines():
        if line.startswith("peak_rss_kib") and peak is not None:
            peak["rss_mib"] = int(line.split()[1]) / 1024
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None, f"no {metrics}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [float(r["step_time_s"]) for r in rows if "step_time_s" in r]
    if len(times) < steps:
        return None, f"metrics.jsonl has {len(times)} step times, expected {steps}"
    if detail is not None:
        tail = [r["stage_ops"] for r in rows if "stage_ops" in r][2:] or [r["stage_ops"] for r in rows]
        detail["stage_ops"] = [{op: statistics.median(step[k].get(op, 0.0) for step in tail)
                                for op in sorted({o for step in tail for o in step[k]})}
                               for k in range(len(tail[0]))]
    return times, f"plan {plan}"


def run_hetero(model_dir: Path, data: Path, steps: int, work: Path, extra: tuple[str, ...] = (),
               peak: dict[str, float] | None = None) -> tuple[list[float] | None, str]:
    """`hetero compile` + `hetero run` (2 stages, NUM_MICRO micro-batches); returns (per-step seconds, note)."""
    plan, note = compile_hetero(model_dir, data, steps, work, extra)
    if plan is None:
        return None, note
    return run_plan(plan, steps, work, peak)


# ---------------------------------------------------------------- W1, all settings


def median_tail(times: list[float]) -> float:
    """Median over steps 3..N (1-based): the first two steps warm up allocators and caches."""
    tail = times[2:] if len(times) > 2 else times
    return statistics.median(tail)


def plan_split(plan: Path) -> list[int]:
    """Decoder layers per stage of a compiled plan."""
    doc = json.loads(plan.read_text())
    return [sum(1 for n in s["node_names"] if n.startswith("layers.")) for s in doc["stages"]]


def run_w1(work: Path, stage_counts: tuple[int, ...] = (2, 3), micro_batches: tuple[int, ...] = (4, 8, 16),
           steps: int = 5, rounds: int = 2, extra_rounds_at: int = 8, baselines: bool = True,
           log: Any = print) -> dict[str, Any]:
    """Run W1 over every (stages, micro-batches) setting; returns {"rows": [...], "baselines": {...}}.

    hetero and the peer alternate; settings with m == ``extra_rounds_at`` get ``rounds`` pairs, the
    others one pair. Rows carry the step times, the bounds and hetero's per-stage ops."""
    cores = os.cpu_count() or 1
    model_dir, data = prepare(work, steps, max(micro_batches))
    result: dict[str, Any] = {"rows": [], "baselines": {}, "cores": cores, "steps": steps,
                              "torch": torch.__version__}
    node_s, opt_s = node_times(model_dir)
    result["node_times_s"], result["opt_s"] = node_s, opt_s
    log("per-node F+B per micro-batch (hetero kernels, alone): " + ", ".join(f"{t * 1e3:.0f}" for t in node_s)
        + f" ms; optimizer {opt_s * 1e3:.0f} ms")
    for stages in stage_counts:
        counts = even_counts(stages)
        split_err = check_split(model_dir, counts)
        for m in micro_batches:
            plan, note = compile_hetero(model_dir, data, steps, work, stages=stages, num_micro=m, name=f"plan-{stages}-{m}")
            row: dict[str, Any] = {"stages": stages, "m": m, "tokens_per_step": SEQ_LEN * MICRO_BATCH * m,
                                   "peer_split": counts, "peer_split_err": split_err, "hetero": [], "peer": []}
            if plan is None:
                row["note"] = note
                log(f"S={stages} m={m}: hetero UNAVAILABLE: {note}")
            else:
                row["hetero_split"] = plan_split(plan)
                row["predicted_s"] = json.loads(plan.read_text())["prediction"]["step_time_s"]
            bound, bound_split = layer_bound(node_s, opt_s, stages, m, cores)
            row["layer_bound_s"], row["layer_bound_split"] = bound, bound_split
            pairs = rounds if m == extra_rounds_at else 1
            for r in range(pairs):
                order = ("hetero", "peer") if r % 2 == 0 else ("peer", "hetero")
                for who in order:
                    if who == "peer":
                        row["peer"].append(median_tail(run_pipelining(model_dir, data, steps, work, counts, m)))
                    elif plan is not None:
                        detail: dict[str, Any] = {}
                        times, note = run_plan(plan, steps, work, detail=detail)
                        if times is None:
                            row["note"] = note
                            log(f"S={stages} m={m}: hetero failed: {note}")
                            continue
                        row["hetero"].append(median_tail(times))
                        row["stage_ops"] = detail.get("stage_ops")
                    log(f"S={stages} m={m} round {r + 1} {who}: {row[who][-1]:.3f} s/step" if row[who] else "")
            for who in ("hetero", "peer"):
                row[f"{who}_s"] = statistics.median(row[who]) if row[who] else None
            if row["hetero_s"] and row["peer_s"]:
                row["speedup"] = row["peer_s"] / row["hetero_s"]
                row["of_layer_bound"] = row["layer_bound_s"] / row["hetero_s"]
            result["rows"].append(row)
    if baselines:
        # Last, and each in a process of its own: multithreaded torch in this process slowed every
        # pipeline run that came after it by up to ~20% (measured 2026-11-23).
        for threads in (1, 2):
            t = _one_process_in_child(model_dir, data, min(steps, 4), threads, work)
            result["baselines"][f"one-process-{threads}t"] = t
            log(f"one process, {threads} thread(s), m={NUM_MICRO}: {t:.3f} s/step")
        one = result["baselines"]["one-process-1t"]
        for row in result["rows"]:
            m, stages = row["m"], row["stages"]
            row["balanced_bound_s"] = one / NUM_MICRO * m / stages * (m + stages - 1) / m
    return result


def _one_process_worker(model_dir: str, data: str, steps: int, threads: int, out: str) -> None:
    Path(out).write_text(json.dumps(run_one_process(Path(model_dir), Path(data), steps, threads, NUM_MICRO)))


def _one_process_in_child(model_dir: Path, data: Path, steps: int, threads: int, work: Path) -> float:
    """run_one_process in a spawned process (its threads and allocations leave this one untouched)."""
    import multiprocessing as mp

    out = work / f"one-process-{threads}t.json"
    proc = mp.get_context("spawn").Process(target=_one_process_worker,
                                           args=(str(model_dir), str(data), steps, threads, str(out)))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"one-process baseline ({threads} threads) exited with {proc.exitcode}")
    return median_tail(json.loads(out.read_text()))


# ---------------------------------------------------------------- report


def print_report(result: dict[str, Any], out: Any = print) -> None:
    """The W1 table, hetero's per-stage ops, then ratios last."""
    base = result["baselines"]
    if base:
        out(f"\none process (stock peft), m={NUM_MICRO}: " + ", ".join(
            f"{k} {v:.3f} s/step ({SEQ_LEN * MICRO_BATCH * NUM_MICRO / v:.0f} tokens/s)" for k, v in base.items()))
    out(f"\n{'S':>2}{'m':>4}{'hetero s':>10}{'peer s':>9}{'hetero tok/s':>14}{'peer tok/s':>12}"
        f"{'layer bound':>13}{'balanced':>10}  splits (hetero / peer / bound)")
    for r in result["rows"]:
        def fmt(x: float | None, w: int, p: int = 3) -> str:
            return f"{x:>{w}.{p}f}" if x else f"{'-':>{w}}"
        tok = r["tokens_per_step"]
        out(f"{r['stages']:>2}{r['m']:>4}{fmt(r['hetero_s'], 10)}{fmt(r['peer_s'], 9)}"
            f"{fmt(tok / r['hetero_s'] if r['hetero_s'] else None, 14, 0)}{fmt(tok / r['peer_s'] if r['peer_s'] else None, 12, 0)}"
            f"{fmt(r['layer_bound_s'], 13)}{fmt(r.get('balanced_bound_s'), 10)}  "
            f"{r.get('hetero_split')} / {r['peer_split']} / {r['layer_bound_split']}")
    out("\nhetero per stage, median seconds per step (F/B compute, RA/RG waiting to receive, SA/SG sending,"
        " STEP optimizer incl. clip_wait for the other stages):")
    for r in result["rows"]:
        for k, ops in enumerate(r.get("stage_ops") or []):
            shown = "  ".join(f"{op} {ops[op]:.3f}" for op in ("F", "B", "RA", "RG", "SA", "SG", "STEP", "clip_wait")
                              if op in ops)
            out(f"  S={r['stages']} m={r['m']:<3} stage {k}: {shown}")
    out("\nratios (> 1: hetero faster; rounds alternate hetero and the peer):")
    for r in result["rows"]:
        if r.get("speedup"):
            runs = ", ".join(f"{p / h:.2f}" for h, p in zip(r["hetero"], r["peer"], strict=False))
            out(f"  S={r['stages']} m={r['m']:<3} hetero vs torch.distributed.pipelining {r['speedup']:.2f}x "
                f"(per round {runs}); {r['of_layer_bound']:.0%} of the layer-granularity bound")


def main(argv: list[str] | None = None) -> int:
    """Run W1 and print the table and ratios."""
    ap = argparse.ArgumentParser(description="W1: hetero runtime vs torch.distributed.pipelining and baselines (CPU)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=2, help="alternating hetero/peer pairs at m=8 (others: one)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the one-process runs")
    ap.add_argument("--keep", type=Path, help="keep the work dir here instead of a temp dir")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--no-transport", action="store_true", help="skip the 16 MiB transport vs raw TCP comparison")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the median is over steps 3..N)")
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetero-w1-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"W1: micro-batches of {MICRO_BATCH} x {SEQ_LEN} tokens, {args.steps} steps per run (median of steps "
              f"3..{args.steps}); torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
        result = run_w1(work, tuple(args.stages), tuple(args.micro_batches), args.steps, args.rounds,
                        baselines=not args.no_baselines, log=lambda s: print(s, flush=True) if s else None)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        print_report(result)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if not args.no_transport:
        # The transport under the pipeline, in the same run: 16 MiB tensors vs a raw TCP socket.
        from bench_transport import report as transport_report

        print("\ntransport (process to process over loopback):")
        transport_report()  # the defaults of bench_transport.py: 32 x 16 MiB per round, best of 6
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
