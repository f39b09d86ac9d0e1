"""Workload W6: every family of hetero/families.py on 3 CPU stages against one transformers+peft process, and
the compile time of each full-size preset (issue 25).

    python bench/bench_families.py                              # ~ 20 minutes on 2 cores
    python bench/bench_families.py --families qwen3,gemma2 --presets none

Per family: a random-init model of W1's sizes (hidden 256, 8 layers, 8 heads, 4 KV heads of 32, vocab 2048,
fp32, seq 128, LoRA r=8 on the family's default targets) with what makes the family (its sliding windows,
softcapping, scaled embeddings, experts: FAMILY_KEYS), compiled by `hetero compile` onto 3 local CPU stages x 1
thread and run by `hetero run` (8 micro-batches of 4 sequences), against the same steps in one process of
stock transformers+peft with 1 and with 2 threads (each in a process of its own). Reported: the median step
over steps 3..N, the plan's prediction, hetero / the faster one-process baseline.

Then `hetero compile model=PRESET hardware=homelab` of every preset in conf/model (wall seconds of the
command, and the plan's predicted step or the one line that refuses it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from w1_bounds import one_process_in_child  # noqa: E402
from w1_hetero import compile_hetero, hetero_cmd, run_plan  # noqa: E402
from w1_model import W1_ARCH, median_tail, prepare  # noqa: E402

from hetero.families import FAMILIES, family  # noqa: E402

LAYERS = 8
# What makes each family, at W1's sizes (head_dim 32, seq 128): values of its real configs where they matter.
FAMILY_KEYS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 64},  # shorter than the sequence: the window's mask matters
    "qwen2": {"use_sliding_window": False},
    "qwen3": {},
    "olmo2": {},
    "phi3": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.03125},
    "gemma2": {"query_pre_attn_scalar": 32, "sliding_window": 64, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"query_pre_attn_scalar": 32, "sliding_window": 64, "hidden_activation": "gelu_pytorch_tanh",
                    "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * (LAYERS // 4)},
    "qwen3_moe": {"moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True},
    "mixtral": {"intermediate_size": 344, "num_local_experts": 4, "num_experts_per_tok": 2},
    "glm4": {"partial_rotary_factor": 0.5},
    "gemma": {"hidden_activation": "gelu_pytorch_tanh"},
    "smollm3": {"no_rope_layers": [1, 1, 1, 0] * (LAYERS // 4)},
    # The expert shapes of the published checkpoints, scaled to hidden 256 (bench/bench_experts.py does the same).
    "olmoe": {"intermediate_size": 128, "num_experts": 64, "num_experts_per_tok": 8},
    "qwen2_moe": {"moe_intermediate_size": 176, "shared_expert_intermediate_size": 704, "num_experts": 60,
                  "num_experts_per_tok": 4, "norm_topk_prob": False},
    "glm4_moe": {"intermediate_size": 684, "moe_intermediate_size": 88, "n_routed_experts": 128,
                 "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                 "topk_group": 1, "partial_rotary_factor": 0.5},
    # DeepSeek-V2-Lite's latent attention and experts scaled the same way (per head: 32 + 16 rotary for q/k, 32 for v).
    "deepseek_v2": {"intermediate_size": 1368, "moe_intermediate_size": 176, "n_routed_experts": 64,
                    "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
                    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
                    "num_key_value_heads": 8, "head_dim": 16},
    # Moonlight-16B-A3B (DeepSeek-V3's layout at V2-Lite's size) scaled the same way.
    "deepseek_v3": {"intermediate_size": 1408, "moe_intermediate_size": 176, "n_routed_experts": 64,
                    "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
                    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
                    "num_key_value_heads": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446,
                    "head_dim": 16},  # the rotary's width (V3's config keeps a head_dim it is given; W1 gives 32)
    # Llama 4 Scout's experts (16, top-1, and a shared one, each 8192 / 5120 of the hidden size) scaled the same way.
    "llama4_text": {"intermediate_size": 408, "intermediate_size_mlp": 816, "num_local_experts": 16,
                    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True,
                    "no_rope_layers": [1, 1, 1, 0] * (LAYERS // 4),
                    "layer_types": (["chunked_attention"] * 3 + ["full_attention"]) * (LAYERS // 4)},
    "gpt_oss": {"intermediate_size": 256, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 64,
                "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2)},
}
CONF_MODELS = Path(__file__).resolve().parents[1] / "conf" / "model"


def architecture(model_type: str) -> dict[str, Any]:
    """W1's sizes as a model of ``model_type``."""
    arch = {k: v for k, v in W1_ARCH.items() if k != "architectures"}  # save_pretrained names the class
    return {**arch, "model_type": model_type, "num_hidden_layers": LAYERS, **FAMILY_KEYS[model_type]}


def bench_family(model_type: str, steps: int, work: Path) -> dict[str, Any]:
    """One family: hetero on 3 stages, then one process with 1 and 2 threads."""
    fam_dir = work / model_type
    fam_dir.mkdir()
    model_dir, data = prepare(fam_dir, steps, architecture=architecture(model_type))
    targets = list(family(model_type).lora_targets_of(architecture(model_type)))
    row: dict[str, Any] = {"family": model_type}
    plan, note = compile_hetero(model_dir, data, steps, fam_dir, (f"lora.target_modules=[{','.join(targets)}]",),
                                stages=3)
    if plan is None:
        row["note"] = note
        return row
    row["predicted_s"] = json.loads(plan.read_text())["prediction"]["step_time_s"]
    times, note = run_plan(plan, steps, fam_dir)
    if times is None:
        row["note"] = note
        return row
    row["hetero_s"] = median_tail(times)
    for threads in (1, 2):
        row[f"one_{threads}t_s"] = one_process_in_child(model_dir, data, steps, threads, fam_dir, targets)
    return row


def compile_preset(name: str, work: Path) -> dict[str, Any]:
    """`hetero compile model=NAME hardware=homelab`: wall seconds and the predicted step, or the refusal."""
    out = work / f"preset-{name}"
    t0 = time.perf_counter()
    proc = subprocess.run(hetero_cmd() + ["compile", f"model={name}", "hardware=homelab", f"output={out}"],
                          capture_output=True, text=True, cwd=work, timeout=1800)
    row: dict[str, Any] = {"preset": name, "wall_s": time.perf_counter() - t0}
    if proc.returncode == 0:
        row["predicted_s"] = json.loads((out / "plan.json").read_text())["prediction"]["step_time_s"]
    else:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        row["note"] = lines[-1] if lines else f"exit {proc.returncode}"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="W6: every family on 3 CPU stages vs one process; preset compiles")
    ap.add_argument("--families", default="all", help="comma-separated model_types, or all")
    ap.add_argument("--presets", default="all", help="comma-separated conf/model presets, all, or none")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (median over 3..N)")
    args = ap.parse_args(argv)
    names = sorted(FAMILIES) if args.families == "all" else args.families.split(",")
    unknown = [n for n in names if n not in FAMILY_KEYS]
    if unknown:
        print(f"unknown families {unknown}; these are benchmarked: {', '.join(sorted(FAMILY_KEYS))}")
        return 2
    presets = ([] if args.presets == "none" else sorted(p.stem for p in CONF_MODELS.glob("*.yaml")
                                                        if p.stem not in ("hf", "tiny"))
               if args.presets == "all" else args.presets.split(","))
    work = Path(tempfile.mkdtemp(prefix="hetero-w6-"))
    try:
        rows = []
        for name in names:
            rows.append(bench_family(name, args.steps, work))
            r = rows[-1]
            print(f"{name}: " + (r.get("note") or f"hetero {r['hetero_s']:.3f} s/step (predicted "
                                 f"{r['predicted_s']:.3f}), one process {r['one_1t_s']:.3f} (1 thread) / "
                                 f"{r['one_2t_s']:.3f} (2 threads)"), flush=True)
        print(f"\n{'family':<13}{'hetero s':>10}{'predicted':>11}{'1 proc 1t':>11}{'1 proc 2t':>11}"
              f"{'hetero/best':>13}")
        for r in rows:
            if "hetero_s" not in r:
                print(f"{r['family']:<13}UNAVAILABLE: {r.get('note')}")
                continue
            best = min(r["one_1t_s"], r["one_2t_s"])
            print(f"{r['family']:<13}{r['hetero_s']:>10.3f}{r['predicted_s']:>11.3f}{r['one_1t_s']:>11.3f}"
                  f"{r['one_2t_s']:>11.3f}{r['hetero_s'] / best:>12.2f}x")
        if presets:
            print(f"\n{'preset':<18}{'compile s':>10}  predicted step on homelab")
            for name in presets:
                p = compile_preset(name, work)
                print(f"{name:<18}{p['wall_s']:>10.1f}  " + (f"{p['predicted_s']:.2f} s" if "predicted_s" in p
                                                              else f"refused: {p['note']}"), flush=True)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
