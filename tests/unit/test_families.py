"""Every family of hetero/families.py trains like one transformers+peft process, to the last bits of float64.

For each family a tiny random-init model (made here, never downloaded) is made a plan of 3 CPU stages in float64
and trained 3 steps (4 micro-batches of packed rows, active clipping, warmup + cosine), one thread per stage over
real loopback transports; per-step losses and the saved adapter must equal plain transformers+peft in float64
(tests/reference.py) within 1e-9 of scale. In float32 the two differ by summation order alone (Adam lifts rounding on
tiny gradients, so float32 checks allow 1e-4 of scale): float64 leaves no room for a bug to hide there.
The runtime's processes (plan.json, the wire between processes, the coordinator's adapter) are checked in
float32 by tests/e2e/test_packing.py (llama and gemma3_text) and tests/e2e/test_runtime_equivalence.py.
A model_type outside the table, and LoRA targets a family does not have, are one line at compile time.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from plans import make_plan, run_in_threads
from reference import assert_close_to_scale, reference_run
from tiny_families import CLIP, COMMON, TINY

from hetero.errors import ConfigError, UnsupportedModelError
from hetero.families import FAMILIES, family
from hetero.runtime.pretrained import resolve_dir
from hetero.runtime.run.data import StepBatches
from hetero.runtime.stage.adapter import ADAPTER_WEIGHTS, load_adapter_state, save_adapter
from hetero.runtime.stage.model import build_stage
from hetero.specs import ModelSpec, TrainSpec

SEQ_LEN = 32
# Packed rows of more than two records each (asserted), records longer than the sliding windows (16), and within
# Llama 4's chunked attention (127 tokens).
EXACT_SEQ_LEN = 96
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=4, steps=3, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.05, seed=3, shuffle=True)  # small enough to clip in every family
EXACT = 1e-9  # float64 (measured: 2e-15 of scale and below for every family, 2026-12-04)
# Gemma 2's attention is soft-capped, so eager (SDPA cannot cap): its softmax runs in float32 even in a float64
# model, in transformers' eager_attention_forward (dtype=torch.float32) and in hetero's eager over a packed row's
# records (runtime/stage/attention.py _eager), on other shapes (each record alone against the masked row). That is
# float32 summation order: 8e-16 of scale at two threads, 7.7e-9 at one (OMP_NUM_THREADS=1, 2026-12-04). With both
# softmaxes (and Gemma 2's RMSNorm, float32 too) patched to float64, the two agree within 1e-14 at one thread and
# hetero's gradients no longer depend on the thread count. 1e-7 is still 1000x the float32 checks' 1e-4.
FLOAT32_SOFTMAX = {"gemma2": 1e-7}


def test_every_family_but_llama_has_a_tiny_model_here() -> None:
    assert set(TINY) | {"llama"} == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_in_float64_equals_the_reference(model_type: str, tiny_spec: ModelSpec, tiny_cache: Path,
                                                tmp_path: Path) -> None:
    from safetensors.torch import load_file

    architecture = {**COMMON, **TINY.get(model_type, {"model_type": "llama"})}
    model_dir = resolve_dir(replace(tiny_spec, name=f"tiny-{model_type}", architecture=architecture))
    train = replace(TRAIN, max_grad_norm=CLIP.get(model_type, TRAIN.max_grad_norm))
    setup = reference_run(model_dir, tmp_path, train, EXACT_SEQ_LEN, dtype=torch.float64,
                          targets=list(family(model_type).lora_targets_of(architecture)))
    plan = make_plan(model_dir, architecture, [2, 2, 2], train=train, lora=setup["lora"], seq_len=EXACT_SEQ_LEN,
                     dtypes=["float64"] * 3)
    assert plan.model.model_type == model_type and plan.data.packing
    batches = StepBatches(plan.data, model_dir, EXACT_SEQ_LEN, train.micro_batch_size, train.num_micro_batches,
                          train.seed, train.shuffle)
    assert len(batches.step(0).record_ids) > 2 * train.micro_batch_size * train.num_micro_batches  # really packed
    stages = [build_stage(plan, k, torch.device("cpu")) for k in range(3)]
    coefs: list[float] = []
    losses = run_in_threads(stages, plan, batches, train.steps, coefs_out=coefs)
    assert min(coefs) < 0.99  # the global clip acted
    exact = FLOAT32_SOFTMAX.get(model_type, EXACT)
    for step, (got, want) in enumerate(zip(losses, setup["losses"], strict=True), start=1):
        assert got == pytest.approx(want, rel=exact), f"{model_type} step {step}: {got} vs {want}"
    # The adapter as the run saves it (the coordinator's writer), read back with safetensors alone.
    save_adapter({k: v for s in stages for k, v in s.lora_state().items()}, setup["lora"], str(model_dir),
                 tmp_path / "adapter")
    trained = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert set(trained) == set(setup["state"]) and trained
    initial = load_adapter_state(Path(setup["lora"].init_from))
    for key, want in setup["state"].items():
        assert trained[key].dtype == torch.float64 and not torch.equal(initial[key].double(), want)
        assert_close_to_scale(key, trained[key], want, exact)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_every_family_compiles(model_type: str) -> None:
    """`hetero compile` traces each family (the equivalence test above starts from a plan built without tracing)."""
    from hetero.compiler.trace import trace
    from hetero.specs import LoraSpec

    spec = ModelSpec(name=f"tiny-{model_type}", architecture={**COMMON, **TINY[model_type]}, seq_len=SEQ_LEN,
                     lora=LoraSpec(r=4, alpha=8, target_modules=list(family(model_type).lora_targets_of(TINY[model_type]))))
    graph = trace(spec)
    assert [n.kind for n in graph.nodes] == ["embedding", *["decoder"] * COMMON["num_hidden_layers"], "norm", "head"]
    assert all(n.fwd_flops_per_token > 0 and n.lora_params > 0 for n in graph.nodes[1:-2])


def test_a_model_type_outside_the_table_is_one_line(tiny_spec: ModelSpec) -> None:
    from hetero.compiler.fxgraph import build_config

    with pytest.raises(UnsupportedModelError, match=r"^model_type 'falcon' is not supported; supported: llama, "
                       r"mistral, qwen2, qwen3, olmo2, phi3, granite, gemma2, gemma3_text, glm4, gemma, smollm3, "
                       r"qwen3_moe, mixtral, olmoe, qwen2_moe, glm4_moe, deepseek_v2, deepseek_v3, llama4_text, gpt_oss \(docs/models\.md lists them"):
        build_config({**COMMON, "model_type": "falcon"})


def test_llama4_limits_are_one_line() -> None:
    """Llama 4's chunked attention and query temperature are plain causal attention below their chunk size and
    floor scale only, and transformers' own block runs every expert on every token: each refused in one line."""
    from hetero.compiler.fxgraph import build_config
    from hetero.families import check_seq_len

    architecture = {**COMMON, **TINY["llama4_text"]}
    check_seq_len(architecture, 127)
    with pytest.raises(ConfigError, match=r"^model.seq_len=128: .* up to 127 tokens only; use model.seq_len<=127$"):
        check_seq_len(architecture, 128)
    with pytest.raises(ConfigError, match="use grouped$"):
        build_config(architecture, experts="eager")
    with pytest.raises(ConfigError, match=r"^model.architecture: attention_chunk_size and floor_scale of a llama4_text model must be integers$"):
        check_seq_len({**architecture, "floor_scale": "8k"}, 64)
    with pytest.raises(ConfigError, match=r"must be integers$"):
        check_seq_len({**architecture, "attention_chunk_size": float("inf")}, 64)
    check_seq_len({**architecture, "attention_chunk_size": None, "attn_temperature_tuning": False}, 100_000)


def test_llama4_under_eager_attention_gets_its_chunked_layers_masks() -> None:
    """Eager attention takes an explicit mask per layer kind: Llama 4's chunked layers get transformers' own."""
    from hetero.runtime.stage.model import StageLayout, _build_config, _skeleton, attention_masks

    model = _skeleton(_build_config({**COMMON, **TINY["llama4_text"]}, "eager"),
                      StageLayout(True, [0, 1, 2, 3], False, False))
    h = torch.zeros(2, 16, COMMON["hidden_size"])
    masks = attention_masks(model, h, torch.arange(16).unsqueeze(0), {"chunked_attention", "full_attention"})
    assert set(masks) == {"chunked_attention", "full_attention"}
    assert all(m is not None for m in masks.values())


def test_lora_targets_a_family_lacks_name_its_own(tiny_spec: ModelSpec) -> None:
    from hetero.compiler.trace import trace

    spec = replace(tiny_spec, architecture={**COMMON, **TINY["phi3"]}, seq_len=SEQ_LEN)
    with pytest.raises(ConfigError, match=r"match no module of this phi3 model; its decoder layers' Linear layers "
                       r"are qkv_proj, o_proj, gate_up_proj, down_proj"):
        trace(spec)


PRESETS = ["llama8b", "mistral7b", "qwen2_7b", "qwen3_8b", "qwen3_14b", "phi4", "mistral_nemo_12b", "gemma3_12b",
           "smollm3_3b", "glm4_9b", "qwen3_30b_a3b", "mixtral_8x7b", "qwen15_moe_a27b", "olmoe_1b_7b", "glm45_air", "gpt_oss_20b",
           "deepseek_v2_lite", "llama4_scout", "gpt_oss_120b"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_presets_cost_model_counts_the_hf_models_parameters(preset: str) -> None:
    """The parameters the cost model places (every unit of the traced graph) are the HF model's, built on the meta
    device from the preset's config.json (the published sizes are checked in tests/unit/test_config.py)."""
    from hetero.compiler.fxgraph import build_meta_model
    from hetero.compiler.trace import trace
    from hetero.config import load

    spec = load([f"model={preset}"]).model
    graph = trace(spec)
    counted = sum(node.num_params for node in graph.nodes)
    if spec.architecture.get("tie_word_embeddings"):  # the head holds its own copy of the embedding (Gemma)
        counted -= next(node.num_params for node in graph.nodes if node.kind == "head")
    meta = sum(p.numel() for p in build_meta_model(spec).parameters())
    assert counted == pytest.approx(meta, rel=0.005), (preset, counted, meta)
    assert family(spec.model_type).lora_targets  # every preset is a family of the table


@pytest.mark.parametrize(("model_type", "prefix"), [("gemma3_text", "language_model.model."),
                                                     ("gemma3_text", "model.language_model."),
                                                     ("llama4_text", "language_model.model.")])
def test_a_text_model_loads_from_a_multimodal_checkpoint(model_type: str, prefix: str, tiny_spec: ModelSpec,
                                                         tiny_cache: Path, tmp_path: Path) -> None:
    """Gemma 3 4B-27B and Llama 4 checkpoints are multimodal: config.json is a gemma3 (llama4) config whose
    text_config is the language model, whose weights live under language_model.model. (the hub's files) or
    model.language_model. (saved by transformers 5). hetero reads the text model, and its stages load the same
    weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hetero.compiler.models import resolve_architecture
    from hetero.runtime.stage.model import build_stage

    architecture = {**COMMON, **TINY[model_type]}
    plain = resolve_dir(replace(tiny_spec, name=f"tiny-{model_type}", architecture=architecture))
    wrapped = tmp_path / "multimodal"
    outer = family(model_type).text_of
    shutil.copytree(plain, wrapped)
    state = load_file(str(plain / "model.safetensors"))
    head = "language_model.lm_head.weight" if prefix.startswith("language_model.") else "lm_head.weight"
    renamed = {(prefix + k.removeprefix("model.") if k.startswith("model.") else head): v for k, v in state.items()}
    save_file(renamed, str(wrapped / "model.safetensors"))
    text = {k: v for k, v in json.loads((plain / "config.json").read_text()).items() if k != "vocab_size"}
    (wrapped / "config.json").write_text(json.dumps({"model_type": outer, "text_config": text,
                                                     "architectures": ["MultimodalForConditionalGeneration"]}))
    found = resolve_architecture(None, str(wrapped))
    assert found["model_type"] == model_type and found["hidden_size"] == 64
    if model_type == "gemma3_text":
        assert found["vocab_size"] == 262208  # the text config's default where config.json leaves it out
    for k in range(3):
        ours = build_stage(make_plan(wrapped, architecture, [2, 2, 2], seq_len=SEQ_LEN), k, torch.device("cpu"))
        want = build_stage(make_plan(plain, architecture, [2, 2, 2], seq_len=SEQ_LEN), k, torch.device("cpu"))
        got, expected = ours.model.state_dict(), want.model.state_dict()
        assert set(got) == set(expected)
        assert all(torch.equal(got[n], expected[n]) for n in expected)
