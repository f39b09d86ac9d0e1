"""Workload W1's definition, one place for every benchmark: the model, its data, the LoRA, the step.

Random-init Llama (hidden 256, 8 layers, 8 heads, 4 KV heads, intermediate 688, vocab 2048, untied
head), seq 128, fp32, sdpa; LoRA r=8 alpha 16 on q,k,v,o,gate,up,down; AdamW lr 1e-3; micro-batches
of 4 sequences (m = 8: 4096 tokens per step).

W3 resizes the model (``use_sizes``): that rebinds W1_ARCH, SEQ_LEN and TOKENS_PER_STEP here, and the
functions below read them when called. Code that runs after a resize reads them as ``w1_model.NAME``.
"""

from __future__ import annotations

import json
import random
import statistics
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
_BASE_ARCH = dict(W1_ARCH)  # use_sizes scales from W1's own sizes, however often it is called


def use_sizes(hidden: int, seq: int) -> None:
    """Point this module's W1 globals at W1's architecture with this hidden size and sequence length.

    Heads stay 8 (4 KV heads), so head_dim = hidden / 8 as in W1 (256 / 8 = 32); the MLP keeps W1's
    intermediate / hidden ratio (688 / 256). The helpers here read these globals when called."""
    global W1_ARCH, SEQ_LEN, TOKENS_PER_STEP
    heads = _BASE_ARCH["num_attention_heads"]
    W1_ARCH = dict(_BASE_ARCH, hidden_size=hidden, head_dim=hidden // heads,
                   intermediate_size=round(_BASE_ARCH["intermediate_size"] * hidden / _BASE_ARCH["hidden_size"]),
                   max_position_embeddings=max(_BASE_ARCH["max_position_embeddings"], seq))
    SEQ_LEN = seq
    TOKENS_PER_STEP = seq * MICRO_BATCH * NUM_MICRO


def prepare(work: Path, steps: int, num_micro: int | None = None,
            architecture: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Save the W1 model (seed 0; ``architecture``: another config of W1's sizes, W6's families) with a tokenizer,
    and a tokens-format data file with enough rows for ``steps`` steps of ``num_micro`` (default NUM_MICRO)
    micro-batches; return both paths."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hetero.runtime.pretrained import build_tokenizer

    arch = dict(architecture or W1_ARCH)
    model_dir = work / ("w1-model" if architecture is None else f"w6-{arch['model_type']}")
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


def peft_model(model_dir: Path, targets: list[str] | None = None) -> torch.nn.Module:
    """The fp32 W1 model with fresh LoRA (seed 0) on ``targets`` (default TARGETS), in training mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from hetero.families import family

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(model_dir))  # sdpa, or eager where the family needs it (gemma2)
    attention = family(config.model_type).attention_impl(config)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=attention)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets or TARGETS,
                        task_type="CAUSAL_LM")
    return get_peft_model(base, config).train()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (HF shift convention)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def median_tail(times: list[float]) -> float:
    """Median over steps 3..N (1-based): the first two steps warm up allocators and caches."""
    tail = times[2:] if len(times) > 2 else times
    return statistics.median(tail)
