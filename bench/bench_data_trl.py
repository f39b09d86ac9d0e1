"""W7's TRL side (bench/bench_data.py): one TRL SFTTrainer run per case, each in a child process of its own.

``python bench/bench_data_trl.py SPEC_JSON`` is that child (bench_data.trl_case starts it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # this file runs as a script beside bench_data.py, or is imported by it

from bench_data import Setup, batch_counts, summarize  # noqa: E402
from w1_model import LR, TARGETS  # noqa: E402


def trl_case(name: str, model_dir: Path, ids: Path, packing: bool, setup: Setup, work: Path) -> dict[str, Any]:
    """One TRL SFTTrainer run in a child process of its own (its threads and memory leave this one alone)."""
    case = work / name
    case.mkdir(parents=True, exist_ok=True)
    out = case / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), json.dumps(
        {"model_dir": str(model_dir), "ids": str(ids), "packing": packing, "setup": asdict(setup),
         "out": str(out), "work": str(case)})]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=case, timeout=3600)
    wall = time.perf_counter() - t0
    (case / "run.log").write_text(proc.stdout + proc.stderr)
    row: dict[str, Any] = {"run": name, "engine": "trl", "packing": packing, "run_wall_s": wall}
    if proc.returncode != 0 or not out.is_file():
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {**row, "error": f"TRL run failed: {lines[-1] if lines else proc.returncode}"}
    child = json.loads(out.read_text())
    return {**row, **summarize(child.pop("per_step"), setup.warmup), **child}


def trl_child(spec: dict[str, Any]) -> None:
    """The TRL run itself (in its own process): writes per-step label/real/computed tokens and times."""
    import torch

    setup = Setup(**spec["setup"])
    torch.set_num_threads(setup.threads)
    import transformers
    import transformers.masking_utils as masking_utils
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    packed_masks = {"forwards": 0, "packed": 0}
    find = masking_utils.find_packed_sequence_indices

    def counting_find(position_ids: Any) -> Any:  # how often transformers saw packed sequences in position_ids
        found = find(position_ids)
        packed_masks["packed"] += found is not None
        return found

    masking_utils.find_packed_sequence_indices = counting_find

    model_dir = spec["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    records = [json.loads(x) for x in Path(spec["ids"]).read_text().splitlines() if x.strip()]
    dataset = Dataset.from_list(records)
    if setup.rows_per_step % setup.trl_micro_batch:
        raise SystemExit(f"TRL micro-batch {setup.trl_micro_batch} does not divide {setup.rows_per_step} rows")
    args = SFTConfig(
        output_dir=str(Path(spec["work"]) / "out"), max_steps=setup.steps,
        per_device_train_batch_size=setup.trl_micro_batch,
        gradient_accumulation_steps=setup.rows_per_step // setup.trl_micro_batch,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", max_length=setup.seq_len, packing=spec["packing"], gradient_checkpointing=False,
        bf16=False, fp16=False, use_cpu=True, logging_steps=10**6, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, seed=setup.seed)
    per_step: list[dict[str, Any]] = []
    shapes: list[list[int]] = []

    class Counting(SFTTrainer):
        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            counts = [batch_counts(b) for b in batches]
            per_step.append({"label": sum(c[0] for c in counts), "real": sum(c[1] for c in counts),
                             "computed": sum(c[2] for c in counts), "micro_batches": len(batches)})
            if len(shapes) < 4:
                shapes.extend(list(b["input_ids"].shape) for b in batches[:1])
            return batches, items

        def compute_loss(self, *a: Any, **kw: Any) -> Any:
            packed_masks["forwards"] += 1
            return super().compute_loss(*a, **kw)

        def training_step(self, *a: Any, **kw: Any) -> Any:  # forward + backward of one micro-batch
            t0 = time.perf_counter()
            try:
                return super().training_step(*a, **kw)
            finally:
                per_step[-1]["fwd_bwd_s"] = per_step[-1].get("fwd_bwd_s", 0.0) + time.perf_counter() - t0

    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not ends:
                ends.append(time.perf_counter())  # the first step's start

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(TARGETS),
                             task_type="CAUSAL_LM")
    torch.manual_seed(0)
    trainer = Counting(model=model, args=args, train_dataset=dataset, processing_class=tok, peft_config=peft_config,
                       callbacks=[Timer()])
    padding_free = bool(getattr(trainer, "padding_free", False))
    trainer.train()
    times = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    if len(times) != setup.steps or len(per_step) < setup.steps:
        raise SystemExit(f"TRL ran {len(times)} timed steps and {len(per_step)} batches, expected {setup.steps}")
    for row, t in zip(per_step, times, strict=False):
        row["time_s"] = t
    attn = getattr(trainer.model.config, "_attn_implementation", None) or "?"
    note = (f"{attn}, padding_free: block-diagonal mask from position_ids in {packed_masks['packed']} of "
            f"{packed_masks['forwards']} forwards (one record alone needs none)" if padding_free else
            f"{attn}, attention_mask (right padding)")
    Path(spec["out"]).write_text(json.dumps({
        "per_step": per_step[:setup.steps], "trl": trl.__version__, "transformers": transformers.__version__,
        "attention": note, "padding_free": padding_free, "packing_strategy": args.packing_strategy if spec["packing"]
        else None, "micro_batch_shapes": shapes, "threads": torch.get_num_threads(),
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps}))


if __name__ == "__main__":
    trl_child(json.loads(sys.argv[1]))
