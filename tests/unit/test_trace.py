"""compiler.trace: the LayerGraph matches the real model (params, LoRA, FLOPs, saved activations)."""

from __future__ import annotations

import re
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_specs import LLAMA8B, LLAMA70B, TINY, tiny_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from hetero.compiler.costs import attention_flops_per_token
from hetero.compiler.fxgraph import build_config, build_meta_model
from hetero.compiler.trace import trace
from hetero.errors import ConfigError, UnsupportedModelError
from hetero.runtime.stage.lora import share_lora_inputs
from hetero.specs import LoraSpec, ModelSpec


def real_tiny(dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(tiny_model().architecture), dtype=dtype)


def test_tiny_nodes_params_and_lora_match_the_real_model():
    spec = tiny_model()
    graph = trace(spec)
    n = spec.architecture["num_hidden_layers"]
    assert [x.name for x in graph.nodes] == ["embed", *(f"layers.{i}" for i in range(n)), "norm", "head"]
    assert [x.kind for x in graph.nodes] == ["embedding"] + ["decoder"] * n + ["norm", "head"]

    model = real_tiny()
    state = model.state_dict()
    names = [p for node in graph.nodes for p in node.param_names]
    assert sorted(names) == sorted(state) and len(names) == len(set(names))
    for node in graph.nodes:
        assert node.num_params == sum(state[p].numel() for p in node.param_names), node.name
    assert graph.nodes[1].linear_params == sum(
        m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)
    )

    # lora_params must equal what peft really adds, per node.
    peft_model = get_peft_model(model, LoraConfig(r=spec.lora.r, target_modules=spec.lora.target_modules))
    added: dict[str, int] = {}
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            layer = re.search(r"\.layers\.(\d+)\.", name)
            unit = f"layers.{layer.group(1)}" if layer else name
            added[unit] = added.get(unit, 0) + p.numel()
    assert sum(added.values()) > 0
    for node in graph.nodes:
        assert node.lora_params == added.get(node.name, 0), node.name


def test_tiny_cut_tensors_and_recomputed_rotary():
    graph = trace(tiny_model())
    hidden = graph.hidden_size
    assert len(graph.edges) == len(graph.nodes) - 1
    for edge in graph.edges:
        sent = [t for t in edge.tensors if not t.recomputed]
        assert [t.name for t in sent] == ["hidden_states"]
        assert sent[0].shape == ["batch", "seq", hidden]
        assert sent[0].bytes_per_token == hidden * 2  # "auto" costs in bfloat16
        assert edge.bytes_per_token == hidden * 2
    # rope cos/sin cross exactly the cuts that feed a decoder layer, and are rebuilt, never sent.
    for edge in graph.edges:
        rope = sorted(t.name for t in edge.tensors if t.recomputed)
        feeds_decoder = graph.nodes[graph.node_index(edge.after) + 1].kind == "decoder"
        assert rope == (["rope_cos", "rope_sin"] if feeds_decoder else []), edge.after
    assert graph.dtype == "bfloat16" and any("auto" in note for note in graph.notes)


def test_decoder_flops_match_flop_counter_on_meta():
    """Analytic FLOPs (matmuls + attention + LoRA) equal torch's FlopCounterMode on a peft-wrapped layer."""
    arch = dict(LLAMA8B, num_hidden_layers=2)
    spec = ModelSpec(
        name="m", architecture=arch, seq_len=512, lora=LoraSpec(r=16, target_modules=["q_proj", "v_proj"])
    )
    graph = trace(spec)
    model = build_meta_model(spec)
    get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    layer = model.model.layers[1]
    seq = spec.seq_len
    hidden = torch.empty(1, seq, 4096, device="meta", dtype=torch.bfloat16)
    rope = torch.empty(1, seq, 128, device="meta", dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        layer(hidden, attention_mask=None, position_embeddings=(rope, rope))
    counted = counter.get_total_flops() / seq
    # sdpa on meta takes the math path (full S x S); the graph counts causal kernels that skip half.
    config = model.config
    expected = (
        counted
        - attention_flops_per_token(config, seq, causal=False)
        + attention_flops_per_token(config, seq)
    )
    assert graph.nodes[2].fwd_flops_per_token == pytest.approx(expected, rel=1e-9)
    assert graph.nodes[2].bwd_flops_per_token > graph.nodes[2].fwd_flops_per_token


def test_activation_estimate_matches_saved_tensors():
    """The per-token activation estimate is within 5% of what autograd saves for a peft layer run the
    way the runtime runs it (LoRA inputs shared with the base projection; bf16, CPU)."""
    spec = tiny_model()
    graph = trace(spec)
    model = get_peft_model(
        real_tiny(torch.bfloat16), LoraConfig(r=spec.lora.r, target_modules=spec.lora.target_modules)
    )
    assert share_lora_inputs(model) == len(spec.lora.target_modules) * spec.architecture["num_hidden_layers"]
    base = model.base_model.model
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch, seq = 2, spec.seq_len
    hidden = torch.randn(batch, seq, graph.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = base.model.rotary_emb(hidden, torch.arange(seq)[None])
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        # Per-token activations only: not weights, not the per-sequence rope tables (leading dim 1).
        if ptr not in params and t.shape[0] != 1 and t.numel() % (batch * seq) == 0:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        base.model.layers[1](hidden, attention_mask=None, position_embeddings=(cos, sin))
    measured = sum(saved.values()) / (batch * seq)
    assert graph.nodes[2].activation_bytes_per_token == pytest.approx(measured, rel=0.05)


def test_llama8b_on_meta_fast_exact_params_and_flops():
    trace(ModelSpec(name="warm", architecture=dict(LLAMA8B, num_hidden_layers=1)))  # first-use imports
    start = time.perf_counter()
    graph = trace(ModelSpec(name="llama8b", architecture=LLAMA8B, seq_len=2048))
    assert time.perf_counter() - start < 2.0
    assert len(graph.nodes) == 35
    total = sum(n.num_params for n in graph.nodes)
    assert total == 8_030_261_248  # Llama-3.1-8B
    embed = graph.nodes[0].num_params
    attention = 32 * attention_flops_per_token(build_config(LLAMA8B), 2048)
    lora = 2 * sum(n.lora_params for n in graph.nodes)
    fwd = sum(n.fwd_flops_per_token for n in graph.nodes)
    head = graph.nodes[-1]
    # Every non-embedding weight is one multiply-add per token, plus attention and LoRA; the frozen head's forward
    # also computes its input gradient (runtime/stage/loss.py), a second multiply-add per weight, and its backward
    # then has nothing left to multiply.
    assert fwd == pytest.approx(2 * (total - embed) + 2 * head.num_params + attention + lora, rel=0.01)
    assert head.fwd_flops_per_token + head.bwd_flops_per_token == pytest.approx(4 * head.num_params, rel=0.01)
    assert graph.nodes[1].param_bytes == pytest.approx(graph.nodes[1].num_params * 2)


def test_llama70b_and_quantized_bytes():
    graph = trace(ModelSpec(name="llama70b", architecture=LLAMA70B, quantization="nf4"))
    assert len(graph.nodes) == 83
    assert sum(n.num_params for n in graph.nodes) == 70_553_706_496
    layer = graph.nodes[1]
    assert layer.param_bytes == pytest.approx(
        layer.linear_params * (0.5 + 4 / 64) + (layer.num_params - layer.linear_params) * 2
    )
    assert graph.nodes[-1].param_bytes == graph.nodes[-1].num_params * 2  # the head is not quantized


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_mistral_and_qwen2_trace(model_type):
    arch = dict(
        model_type=model_type, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=model_type == "qwen2",
    )  # fmt: skip
    graph = trace(ModelSpec(name=model_type, architecture=arch, seq_len=64))
    assert len(graph.nodes) == 6 and graph.model_type == model_type
    head = graph.nodes[-1]
    if model_type == "qwen2":  # q/k/v carry biases; the tied head loads the embedding
        assert "model.layers.0.self_attn.q_proj.bias" in graph.nodes[1].param_names
        assert head.param_names == ["model.embed_tokens.weight"]
        assert any("tie_word_embeddings" in note for note in graph.notes)
    else:
        assert head.param_names == ["lm_head.weight"]


def test_bad_models_give_one_line_errors():
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2"):
        trace(ModelSpec(name="g", architecture={"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="target_modules"):
        trace(tiny_model(lora=LoraSpec(target_modules=["c_attn"])))
    with pytest.raises(ConfigError, match="dtype"):
        trace(tiny_model(dtype="float64"))


# --- compiler.models: architecture from a local dir or the local HF cache (never the network) ---


def test_resolve_architecture_from_dir_and_cache(tmp_path, monkeypatch):
    import json

    from hetero.compiler.models import resolve_architecture

    config = dict(TINY["model"]["architecture"], torch_dtype="bfloat16")
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    assert resolve_architecture(None, str(model_dir)) == config
    # A declared architecture that agrees is merged (declared keys win where they are free to differ).
    merged = resolve_architecture(
        {"model_type": "llama", "hidden_size": 64, "rope_theta": 5e5}, str(model_dir)
    )
    assert merged["rope_theta"] == 5e5 and merged["num_hidden_layers"] == config["num_hidden_layers"]

    # A hub id resolves through the local HF cache layout (refs/main -> snapshots/<rev>/config.json).
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--acme--tiny-llama" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    assert resolve_architecture(None, "acme/tiny-llama") == config
    graph = trace(ModelSpec(name="cached", architecture=resolve_architecture(None, "acme/tiny-llama")))
    assert len(graph.nodes) == config["num_hidden_layers"] + 3


def test_resolve_architecture_errors(tmp_path, monkeypatch):
    import json

    import huggingface_hub.constants as hf_constants

    from hetero.compiler.models import resolve_architecture

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_architecture(None, str(model_dir))
    (model_dir / "config.json").write_text(json.dumps(TINY["model"]["architecture"]))
    with pytest.raises(ConfigError) as err:
        resolve_architecture(
            {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 3}, str(model_dir)
        )
    message = str(err.value)
    assert (
        "hidden_size: declared 128, config.json 64" in message and "num_hidden_layers: declared 3" in message
    )
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        resolve_architecture(None, "acme/not-downloaded")
    with pytest.raises(ConfigError, match="no such directory"):
        resolve_architecture(None, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="model.pretrained"):
        resolve_architecture(None, None)
    assert resolve_architecture({"model_type": "llama"}, "hetero:tiny") == {"model_type": "llama"}
