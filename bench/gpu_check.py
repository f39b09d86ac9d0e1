"""hetero on a real GPU: does each path run, and does the plan's prediction hold? (one CUDA GPU)

    python bench/gpu_check.py [--out DIR] [--steps 6] [--only bf16 nf4 mixed stream]

Builds a random-init Llama of about 0.6 B parameters (hidden 2048, 12 layers; built locally, no
download) and a tokens-format data file of records of 40 to 500 tokens, then for each case runs
`hetero compile` on a fleet file written for this machine and `hetero run` on the plan:

  bf16    one stage on the GPU, bf16 LoRA: measured / predicted step time
  nf4     QLoRA (NF4 base) as two stage processes sharing the one GPU (the wire between them on loopback)
  mixed   the GPU and a CPU stage of this host in one pipeline (the CPU stage gets one decoder layer)
  stream  every layer's frozen weights streamed from pinned host RAM (planner.offload=full)

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

CASES = ("bf16", "nf4", "mixed", "stream")
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
    from hetero.runtime.tools.run_compare import read_metrics, step_lines

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
        code, tail = hetero(["run", str(plan_dir / "plan.json"), "--run-dir", str(run_dir), "--no-progress"], log,
                            timeout)
    row["measured_gpu_gb"] = round(used.peak_gb, 2)  # the card's, CUDA contexts included (0.5 GB or so each)
    if code != 0:
        return dict(row, ok=False, error=f"run exit {code}: {tail[-1500:]}")
    rows = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    times = [float(r["step_time_s"]) for r in rows]
    measured = statistics.median(times[1:] or times)
    losses = [float(r["loss"]) for r in rows]
    adapter = run_dir / "adapter" / "adapter_model.safetensors"
    return dict(row, ok=adapter.is_file() and losses[-1] < losses[0], measured_s=round(measured, 4),
                ratio=round(measured / row["predicted_s"], 3), first_step_s=round(times[0], 3),
                tokens_per_s=rows[-1].get("tokens_per_s"), loss_first=round(losses[0], 4),
                loss_last=round(losses[-1], 4), adapter_saved=adapter.is_file(), shares_gpu=len(gpu_stages) > 1)


def main() -> None:
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
