"""`hetero generate RUN_DIR --prompt "..."`: sample from the base model plus the run's trained adapter.

Runs in this process with transformers + peft (the whole model must fit on this host: fine for
trying out an adapter; pipelined generation across hosts is not built yet). Unless --raw, the prompt
is wrapped the way the run's training data was: as a user turn of the tokenizer's chat template for
data.format=chat, else in the Alpaca template the demo data trains with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hetero.errors import CheckpointError
from hetero.plan import Plan


def generate(run_dir: str | Path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0,
             raw: bool = False, device: str = "cpu") -> str:
    """The text the base model + ``run_dir/adapter`` continues ``prompt`` with."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hetero.runtime.base.prompts import render_alpaca
    from hetero.runtime.pretrained import resolve_dir

    run_dir = Path(run_dir)

    plan = Plan.load(run_dir / "plan.json")
    adapter = run_dir / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise CheckpointError(f"{run_dir}: no trained adapter (adapter/adapter_config.json); did the run finish?")
    model_dir = resolve_dir(plan.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    chat = not raw and plan.data.format == "chat" and bool(getattr(tokenizer, "chat_template", None))
    if chat:  # the template writes its own BOS, if any
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt if raw else render_alpaca({"instruction": prompt})
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None and not chat:
        ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                             max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main_generate(argv: list[str]) -> int:
    """`hetero generate RUN_DIR --prompt "..." [--max-new-tokens N] [--temperature T] [--raw]`."""
    ap = argparse.ArgumentParser(prog="hetero generate", description="Sample from base model + trained adapter.")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--raw", action="store_true",
                    help="do not wrap the prompt in the training template (alpaca, or the chat template)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps")
    args = ap.parse_args(argv)
    text = generate(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.raw, args.device)
    if text.strip():
        print(text)
    else:  # a blank line would look like a crash
        print("(empty: the model's first token was end-of-sequence; try --temperature 0.8 or --raw)",
              file=sys.stderr)
    return 0
