"""hetero on a real GPU: does each path run, and does the plan's prediction hold? (one CUDA GPU)

    python bench/gpu_check.py [--out DIR] [--steps 6] [--only bf16 nf4 mixed stream]

Builds a random-init Llama of about 0.6 B parameters (hidden 2048, 12 layers; built locally, no
download) and a tokens-format data file of records of 40 to 500 tokens, then for each case runs
`hetero compile` on a fleet file written for this machine and `hetero run` on the plan:

  bf16    one stage on the GPU, bf16 LoRA: measured / predicted step time
  nf4     QLoRA (NF4 base) as two stage processes sharing the one GPU (the wire between them on loopback)
  mixed   the GPU and a CPU stage of this host in one pipeline (the CPU stage gets one decoder layer)
  stream  every layer's frozen weights streamed from pinned host RAM (planner.offload=full)
  peft    the reference users compare with: plain transformers+peft in one process on the bf16 case's plan
          (its model, LoRA, optimizer settings and the very same packed rows), step time, tokens/s, and the
          operators one micro-batch issues (so time per operator on this machine is measured, not assumed)
  torch   the bf16 case unpacked (data.packing=false, which that engine needs) under `--engine torch`
          (torch.distributed.pipelining, NCCL on the one card)

The GPU's datasheet is picked by its name (h200.yaml or h100_sxm.yaml; another card: h100_sxm's with the
card's memory). Each case prints the split, predicted and measured step time (median after the first
step), trained tokens/s, peak GPU memory the stages reported, the loss going down, and that the adapter
was saved. The last line is a JSON summary; --json writes it to a file. Two GPU stages on one card
share it, so their measured time is expected above a prediction that gives each stage a whole card: the
table says which cases are like that. Needs torch with CUDA, bitsandbytes for nf4.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

CASES = ("bf16", "peft", "torch", "nf4", "mixed", "stream")
HIDDEN, LAYERS, SEQ_LEN = 2048, 12, 512
ARCH = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": HIDDEN,
    "intermediate_size": 5632, "num_hidden_layers": LAYERS, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip


def gpu_type() -> tuple[str, float | None]:
    """The hardware_specs/ type for this GPU and a memory override (GB) when the datasheet is another card's."""
    name = torch.cuda.get_device_name(0)
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    if "H200" in name:
        return "h200", None
    if "H100" in name and total_gb > 70:
        return "h100_sxm", None
    return "h100_sxm", round(total_gb * 0.95, 1)


def fleet(out: Path, case: str, port: int) -> str:
    """Write this machine's fleet file for ``case`` under out/fleets/hardware/; return its name."""
    kind, memory = gpu_type()
    gpu = {"type": kind, "index": 0}
    if memory is not None:
        gpu["memory_gb"] = memory
    if case == "nf4":  # two stage processes on the one card: each is told half of it
        half = (memory or (141 if kind == "h200" else 80)) / 2
        devices = [dict(gpu, memory_gb=half), dict(gpu, memory_gb=half, index=0)]
    elif case == "mixed":
        devices = [gpu, {"type": "cpu", "threads": max(1, (os.cpu_count() or 2) // 2), "memory_gb": 32}]
    elif case == "stream":  # a card too small to hold the layers: the planner must stream them
        devices = [dict(gpu, memory_gb=1.6)]
    else:
        devices = [gpu]
    host: dict[str, Any] = {"name": "gpubox", "address": "127.0.0.1", "port": port, "devices": devices}
    if case == "stream":
        host["ram_gb"] = 32
    name = f"gpu_{case}"
    path = out / "fleets" / "hardware" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name, "hosts": [host]}, indent=1))  # JSON is YAML
    return name


def data_file(out: Path, records: int = 3000) -> Path:
    """Pre-tokenized records of uneven length (40-500 tokens), as real instruction data is. Each token follows
    from the one before by one fixed rule (a bigram map), so a few steps of LoRA visibly lower the loss."""
    path = out / "tokens.jsonl"
    rng = random.Random(0)
    vocab = ARCH["vocab_size"] - 3
    with path.open("w") as f:
        for _ in range(records):
            n = min(500, int(rng.lognormvariate(5.0, 0.6)) + 40)
            ids = [rng.randrange(vocab)]
            while len(ids) < n:
                ids.append((ids[-1] * 7 + 3) % vocab)
            f.write(json.dumps({"input_ids": [3 + t for t in ids]}) + "\n")
    return path


def model_args() -> list[str]:
    return ["model=tiny", "model.name=gpucheck", f"model.seq_len={SEQ_LEN}", "model.dtype=auto"] + [
        f"model.architecture.{k}={json.dumps(v) if not isinstance(v, str) else v}"
        for k, v in ARCH.items() if k != "architectures"
    ]  # fmt: skip


class GpuMemory:
    """The card's peak memory in use (GB) while the block runs, above what was in use when it began: polled
    from the driver every 50 ms, so every stage process on the card counts."""

    def __enter__(self) -> GpuMemory:
        import threading

        free, total = torch.cuda.mem_get_info(0)
        self.base, self.total, self.peak = total - free, total, total - free
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            free, _ = torch.cuda.mem_get_info(0)
            self.peak = max(self.peak, self.total - free)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_gb(self) -> float:
        return (self.peak - self.base) / 1e9


def hetero(args: list[str], log: Path, timeout: float) -> tuple[int, str]:
    with log.open("a") as f:
        f.write(f"\n$ hetero {' '.join(args)}\n")
        f.flush()
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "hetero.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
        f.write(f"[exit {code} after {time.monotonic() - t0:.1f} s]\n")
    text = log.read_text()
    return code, text[-3000:]


def run_case(out: Path, case: str, data: Path, steps: int, port: int, timeout: float) -> dict[str, Any]:
    from hetero.runtime.run.metrics_file import NAME, read_metrics

    name = fleet(out, case, port)
    plan_dir, run_dir, log = out / f"plan-{case}", out / f"run-{case}", out / f"{case}.log"
    micro, m = (1, 2) if case == "mixed" else (4, 8)  # the CPU stage's layer: seconds per row
    steps = min(steps, 4) if case == "mixed" else steps
    args = ["compile", "--config-dir", str(out / "fleets"), f"hardware={name}", *model_args(),
            f"data.path={data}", "data.format=tokens", f"train.micro_batch_size={micro}",
            f"train.num_micro_batches={m}", f"train.steps={steps}", "train.lr=1e-3", f"output={plan_dir}",
            "planner.time_limit_s=20"]
    if case == "nf4":
        args += ["model.quantization=nf4", "planner.num_stages=2", "planner.replicas=1"]
    if case == "mixed":
        kind = gpu_type()[0]
        gpu_name = f"gpubox.{kind}{'_' if kind[-1].isdigit() else ''}0"  # hetero/hardware.py's device names
        args += [f"planner.split=[{LAYERS - 1},1]", f"planner.devices=[{gpu_name},gpubox.cpu0]"]
    if case == "stream":
        args += ["planner.offload=full"]
    row: dict[str, Any] = {"case": case}
    if case == "peft":  # on the bf16 case's plan
        return peft_case(out, row, timeout)
    if case == "torch":
        args += ["data.packing=false"]
    code, tail = hetero(args, log, timeout)
    if code != 0:
        return dict(row, ok=False, error=f"compile exit {code}: {tail[-600:]}")
    plan = json.loads((plan_dir / "plan.json").read_text())
    row["stages"] = [f"{s['device']}:{sum(n.startswith('layers.') for n in s['node_names'])}" for s in plan["stages"]]
    row["streamed_layers"] = [len(s["stream_layers"]) for s in plan["stages"]]
    row["recomputed_layers"] = [len(s["recompute_layers"]) for s in plan["stages"]]
    row["predicted_s"] = plan["prediction"]["step_time_s"]
    gpu_stages = [s for s in plan["stages"] if s["backend"] == "cuda"]
    row["predicted_gpu_gb"] = round(sum(s["memory"]["total_gb"] for s in gpu_stages), 2)
    with GpuMemory() as used:
        code, tail = hetero(["run", str(plan_dir / "plan.json"), "--run-dir", str(run_dir), "--no-progress",
                             *(["--engine", "torch"] if case == "torch" else [])], log, timeout)
    row["measured_gpu_gb"] = round(used.peak_gb, 2)  # the card's, CUDA contexts included (0.5 GB or so each)
    if code != 0:
        return dict(row, ok=False, error=f"run exit {code}: {tail[-1500:]}")
    rows = read_metrics(run_dir / NAME).steps
    times = [s.step_time_s for s in rows]
    measured = statistics.median(times[1:] or times)
    losses = [s.loss for s in rows]
    adapter = run_dir / "adapter" / "adapter_model.safetensors"
    return dict(row, ok=adapter.is_file() and losses[-1] < losses[0], measured_s=round(measured, 4),
                ratio=round(measured / row["predicted_s"], 3), first_step_s=round(times[0], 3),
                tokens_per_s=rows[-1].tokens_per_s, loss_first=round(losses[0], 4),
                loss_last=round(losses[-1], 4), adapter_saved=adapter.is_file(), shares_gpu=len(gpu_stages) > 1)


def peft_case(out: Path, row: dict[str, Any], timeout: float) -> dict[str, Any]:
    """transformers+peft alone (a child process: its own CUDA context) on the bf16 case's plan and rows."""
    plan_dir, log, result = out / "plan-bf16", out / "peft.log", out / "peft.json"
    if not (plan_dir / "plan.json").is_file():
        return dict(row, ok=False, error="needs the bf16 case's plan (run the bf16 case first)")
    row["predicted_s"] = json.loads((plan_dir / "plan.json").read_text())["prediction"]["step_time_s"]
    with log.open("w") as f, GpuMemory() as used:
        code = subprocess.run([sys.executable, __file__, "--peft-child", str(plan_dir / "plan.json"), str(result)],
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    row["measured_gpu_gb"] = round(used.peak_gb, 2)
    if code != 0:
        return dict(row, ok=False, error=f"peft exit {code}: {log.read_text()[-1500:]}")
    child = json.loads(result.read_text())
    times = child.pop("step_times")
    measured = statistics.median(times[1:] or times)
    return dict(row, **child, ok=child["loss_last"] < child["loss_first"], measured_s=round(measured, 4),
                ratio=round(measured / row["predicted_s"], 3), first_step_s=round(times[0], 3),
                tokens_per_s=round(child["label_tokens"] / measured))


def peft_child(plan_json: Path, result: Path) -> None:
    """transformers+peft alone on the plan's model, LoRA, optimizer and packed rows (bf16, SDPA, one process).

    The rows are hetero's own (StepBatches), with each record's positions restarting at 0; SDPA's causal mask spans
    the whole row (records see the records before them in their row), which costs the same arithmetic as masking them
    apart and fewer operator calls: a fair lower bound on what hetero's stage could take. (That holds because the
    forward keeps transformers' default use_cache=True: without a cache, transformers reads packed rows from the
    position ids and builds block-diagonal masks.)"""
    from peft import LoraConfig, get_peft_model
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    from hetero.plan import Plan
    from hetero.runtime.pretrained import resolve_dir
    from hetero.runtime.run.data import StepBatches

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to try the script on a machine without one
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    plan = Plan.load(plan_json)
    model_dir, lora, train = resolve_dir(plan.model), plan.model.lora, plan.train
    torch.manual_seed(train.seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
    model = get_peft_model(base, LoraConfig(r=lora.r, lora_alpha=int(lora.alpha), lora_dropout=lora.dropout,
                                            target_modules=list(lora.target_modules))).to(dev)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    batches = StepBatches(plan.data, model_dir, plan.model.seq_len, train.micro_batch_size, train.num_micro_batches,
                          train.seed, train.shuffle)

    def micro(ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None, n: int) -> torch.Tensor:
        logits = model(input_ids=ids.to(dev), position_ids=None if positions is None else positions.to(dev)).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(dev),
                                                 ignore_index=-100, reduction="sum")
        (loss / n).backward()
        return loss.detach()

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    times, losses, labels_total = [], [], 0
    for i in range(train.steps):
        batch = batches.step(i)
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=dev)
        for m in range(batch.input_ids.shape[0]):
            pos = None if batch.position_ids is None else batch.position_ids[m]
            total += micro(batch.input_ids[m], batch.labels[m], pos, batch.num_label_tokens)
        torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total) / batch.num_label_tokens)
        sync()
        times.append(time.perf_counter() - t0)
        labels_total = batch.num_label_tokens
        print(f"step {i}: loss {losses[-1]:.4f} {times[-1]:.3f} s", flush=True)
    batch = batches.step(0)
    pos = None if batch.position_ids is None else batch.position_ids[0]
    sync()
    t0 = time.perf_counter()
    micro(batch.input_ids[0], batch.labels[0], pos, batch.num_label_tokens)
    sync()
    one = time.perf_counter() - t0
    with Count():
        micro(batch.input_ids[0], batch.labels[0], pos, batch.num_label_tokens)
    opt.zero_grad(set_to_none=True)
    result.write_text(json.dumps({
        "step_times": times, "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "label_tokens": labels_total, "ops_per_micro_batch": Count.calls, "micro_batch_s": round(one, 4),
        "us_per_op": round(one / max(Count.calls, 1) * 1e6, 1)}))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--peft-child":
        peft_child(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", nargs="*", choices=CASES)
    ap.add_argument("--timeout", type=float, default=300.0, help="per hetero command, seconds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (torch.cuda.is_available() is False)")
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers

    try:
        import bitsandbytes as bnb

        bnb_version = bnb.__version__
    except Exception as exc:  # noqa: BLE001 - reported, nf4 then fails with its own error
        bnb_version = f"missing ({type(exc).__name__})"
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "bitsandbytes": bnb_version, "spec": gpu_type()[0],
           "date": time.strftime("%Y-%m-%d")}
    print("environment:", json.dumps(env), flush=True)
    data = data_file(args.out)
    results = []
    for i, case in enumerate(args.only or CASES):
        t0 = time.monotonic()
        row = run_case(args.out, case, data, args.steps, 29600 + 20 * i, args.timeout)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(row), flush=True)
        results.append(row)
    summary = {"environment": env, "results": results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    sys.exit(0 if all(r.get("ok") for r in results) else 1)


if __name__ == "__main__":
    main()
