"""Workload W1 (/work/shared/BENCHMARKS.md): the hetero runtime against its baselines on this CPU.

    python bench/bench_runtime.py                 # ~ a few minutes on 2 cores
    python bench/bench_runtime.py --steps 6 --skip hetero

Model: random-init Llama (hidden 256, 8 layers, 8 heads, 4 KV heads, intermediate 688, vocab 2048,
untied head), seq 128, fp32, sdpa; LoRA r=8 alpha 16 on q,k,v,o,gate,up,down; AdamW lr 1e-3;
4 sequences x 8 micro-batches = 4096 tokens per step. Every run below trains the same model on the
same token stream, measured in this one script run:

  one-process-1t    all micro-batches in one process, 1 thread (running the stages one at a time)
  one-process-2t    the same with 2 threads (the best one device can do here)
  torch-pipelining  torch.distributed.pipelining, manual stages, Schedule1F1B, gloo, 2 procs x 1 thread
  hetero            `hetero compile` + `hetero run` (2 CPU stages x 1 thread over ZeroMQ loopback)

Reported: median step time over steps 3..N, tokens/s, ratios, and the balanced 2-stage 1F1B bound
(one-process-1t time / 2 x (m+1)/m).
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


def prepare(work: Path, steps: int) -> tuple[Path, Path]:
    """Save the W1 model (seed 0) with a tokenizer, and a tokens-format data file; return both paths."""
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
        for _ in range(steps * MICRO_BATCH * NUM_MICRO):
            f.write(json.dumps({"input_ids": [rng.randrange(3, W1_ARCH["vocab_size"]) for _ in range(SEQ_LEN)]}) + "\n")
    return model_dir, data


def step_batches(model_dir: Path, data: Path) -> Any:
    """The StepBatches every baseline reads (the hetero run reads the same file the same way)."""
    from hetero.runtime.data import StepBatches
    from hetero.specs import DataSpec

    return StepBatches(DataSpec(path=str(data), format="tokens"), model_dir, SEQ_LEN, MICRO_BATCH, NUM_MICRO,
                       seed=0, shuffle=True)


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


def run_one_process(model_dir: Path, data: Path, steps: int, threads: int) -> list[float]:
    """All micro-batches in one process with ``threads`` threads; returns per-step seconds."""
    torch.set_num_threads(threads)
    model = peft_model(model_dir)
    batches = step_batches(model_dir, data)
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


# ---------------------------------------------------------------- baseline: torch.distributed.pipelining


class FrontStage(torch.nn.Module):
    """Embedding + the first decoder layers of a (peft-wrapped) Llama."""

    def __init__(self, llama: Any, layers: range) -> None:
        super().__init__()
        self.embed = llama.model.embed_tokens
        self.layers = torch.nn.ModuleList(llama.model.layers[i] for i in layers)
        self.rotary = llama.model.rotary_emb

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
        rope = self.rotary(hidden, position_ids=position_ids)
        for layer in self.layers:  # attention_mask None: sdpa runs causal, as the full model does
            hidden = layer(hidden, position_embeddings=rope, position_ids=position_ids)
        return hidden


class BackStage(FrontStage):
    """The last decoder layers + final norm + LM head."""

    def __init__(self, llama: Any, layers: range) -> None:
        super().__init__(llama, layers)
        del self.embed
        self.norm = llama.model.norm
        self.head = llama.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
        rope = self.rotary(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=rope, position_ids=position_ids)
        return self.head(self.norm(hidden))


def split_stages(model: torch.nn.Module) -> tuple[FrontStage, BackStage]:
    """Two equal halves of the decoder stack (the even split a balanced pipeline would pick)."""
    llama = model.base_model.model
    half = W1_ARCH["num_hidden_layers"] // 2
    return FrontStage(llama, range(half)), BackStage(llama, range(half, W1_ARCH["num_hidden_layers"]))


def _pipelining_worker(rank: int, port: int, model_dir: str, data: str, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = peft_model(Path(model_dir))
    module = split_stages(model)[rank]
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    batches = step_batches(Path(model_dir), Path(data))
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    divisor = {"n": 1}

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, labels) / divisor["n"]

    # Our loss is already divided by the step's label tokens: no extra 1/M scaling.
    schedule = Schedule1F1B(stage, n_microbatches=NUM_MICRO, loss_fn=loss_fn, scale_grads=False)
    times = []
    for i in range(steps):
        batch = batches.step(i)
        divisor["n"] = batch.num_label_tokens
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(batch.input_ids.reshape(-1, SEQ_LEN))
        else:
            schedule.step(target=batch.labels.reshape(-1, SEQ_LEN))
        # Global-norm clipping across both stages, as one device would clip.
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


def run_pipelining(model_dir: Path, data: Path, steps: int, work: Path) -> list[float]:
    """torch.distributed.pipelining with Schedule1F1B over gloo, 2 processes x 1 thread."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "pipelining.json"
    mp.start_processes(_pipelining_worker, args=(port, str(model_dir), str(data), steps, str(out)), nprocs=2,
                       join=True, start_method="spawn")
    return json.loads(out.read_text())


def check_split(model_dir: Path) -> float:
    """Max |logits| difference between the two stage modules chained and the whole model."""
    model = peft_model(model_dir).eval()
    front, back = split_stages(model)
    ids = torch.randint(3, W1_ARCH["vocab_size"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float((back(front(ids)) - model(input_ids=ids).logits).abs().max())


# ---------------------------------------------------------------- hetero itself


HARDWARE_YAML = """\
name: w1
hosts:
  - name: localhost
    address: 127.0.0.1
    port: {port}
    devices:
      - {{type: cpu, count: 2, threads: 1}}
"""


# Runs a command and prints the largest peak RSS (KiB) of any process it waited for (stage workers included).
_PEAK_RSS = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
             "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
             "sys.exit(rc)")


def run_hetero(model_dir: Path, data: Path, steps: int, work: Path, extra: tuple[str, ...] = (),
               peak: dict[str, float] | None = None) -> tuple[list[float] | None, str]:
    """`hetero compile` + `hetero run` as subprocesses; returns (per-step seconds, note).

    ``extra``: more compile overrides; ``peak``: filled with the run's largest process peak RSS (MiB)."""
    conf = work / "conf"
    (conf / "hardware").mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1] + 1  # the coordinator takes base port - 1
    (conf / "hardware" / "w1.yaml").write_text(HARDWARE_YAML.format(port=port))
    out, run_dir = work / "plan", work / "run"
    hetero = [sys.executable, "-m", "hetero.cli"] if not shutil.which("hetero") else ["hetero"]
    compile_cmd = hetero + [
        "compile", "-cd", str(conf), "model=hf", f"model.pretrained={model_dir}", f"model.seq_len={SEQ_LEN}",
        "model.dtype=float32", "lora.r=8", "lora.alpha=16", "hardware=w1", f"train.micro_batch_size={MICRO_BATCH}",
        f"train.num_micro_batches={NUM_MICRO}", f"train.steps={steps}", f"train.lr={LR}", "train.schedule=1f1b",
        f"data.path={data}", "data.format=tokens", "planner.num_stages=2", f"output={out}", *extra,
    ]
    shutil.rmtree(run_dir, ignore_errors=True)
    run_cmd = hetero + ["run", str(out / "plan.json"), "--run-dir", str(run_dir), "--no-progress"]
    for cmd in (compile_cmd, [sys.executable, "-c", _PEAK_RSS, *run_cmd]):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=1800)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return None, f"`{' '.join(cmd[:4])}` failed: {lines[-1] if lines else proc.returncode}"
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
    return times, f"plan {out / 'plan.json'}"


# ---------------------------------------------------------------- report


def median_tail(times: list[float]) -> float:
    """Median over steps 3..N (1-based): the first two steps warm up allocators and caches."""
    tail = times[2:] if len(times) > 2 else times
    return statistics.median(tail)


def main(argv: list[str] | None = None) -> int:
    """Run W1 and print the table and ratios."""
    ap = argparse.ArgumentParser(description="W1: hetero runtime vs baselines (CPU)")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (median over 3..N)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["one-process-1t", "one-process-2t", "pipelining", "hetero"])
    ap.add_argument("--keep", type=Path, help="keep the work dir here instead of a temp dir")
    ap.add_argument("--no-transport", action="store_true", help="skip the 16 MiB transport vs raw TCP comparison")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the median is over steps 3..N)")
    work = args.keep or Path(tempfile.mkdtemp(prefix="hetero-w1-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> int:
    model_dir, data = prepare(work, args.steps)
    print(f"W1: {TOKENS_PER_STEP} tokens/step (m={NUM_MICRO} x {MICRO_BATCH} x {SEQ_LEN}), {args.steps} steps, "
          f"median over steps 3..{args.steps}; torch {torch.__version__}, {os.cpu_count()} CPUs")
    results: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    if "one-process-1t" not in args.skip:
        results["one-process-1t"] = median_tail(run_one_process(model_dir, data, args.steps, 1))
    if "one-process-2t" not in args.skip:
        results["one-process-2t"] = median_tail(run_one_process(model_dir, data, args.steps, 2))
    if "pipelining" not in args.skip:
        torch.set_num_threads(1)
        notes["torch-pipelining"] = f"stage split checked: max |dlogits| {check_split(model_dir):.1e}"
        results["torch-pipelining"] = median_tail(run_pipelining(model_dir, data, args.steps, work))
    if "hetero" not in args.skip:
        times, note = run_hetero(model_dir, data, args.steps, work)
        results["hetero"] = median_tail(times) if times else None
        notes["hetero"] = note if times else f"UNAVAILABLE: {note}"

    print(f"\n{'run':<18}{'step s':>10}{'tokens/s':>12}  note")
    for name, t in results.items():
        shown = f"{t:>10.3f}{TOKENS_PER_STEP / t:>12.0f}" if t else f"{'-':>10}{'-':>12}"
        print(f"{name:<18}{shown}  {notes.get(name, '')}")

    one = results.get("one-process-1t")
    bound = one / 2 * (NUM_MICRO + 1) / NUM_MICRO if one else None
    if bound:
        print(f"{'balanced bound':<18}{bound:>10.3f}{TOKENS_PER_STEP / bound:>12.0f}  "
              f"one-process-1t / 2 x (m+1)/m, m={NUM_MICRO}")
    print("\nratios (speedup = other's step time / this step time; > 1 means faster):")
    for name in ("hetero", "torch-pipelining"):
        t = results.get(name)
        if not t:
            continue
        for base in ("one-process-1t", "one-process-2t", "torch-pipelining"):
            b = results.get(base)
            if base != name and b:
                print(f"  {name} vs {base:<17} {b / t:6.2f}x")
        if bound:
            print(f"  {name} reaches {bound / t:6.1%} of the balanced-pipeline bound")
    if "hetero" in results and results["hetero"] is None:
        print(f"  hetero: {notes['hetero']}")
    if not args.no_transport:
        # The transport under the pipeline, in the same run: 16 MiB tensors vs a raw TCP socket.
        from bench_transport import report as transport_report

        print("\ntransport (process to process over loopback):")
        transport_report()  # the defaults of bench_transport.py: 32 x 16 MiB per round, best of 6
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
