"""Mixtures of experts: what the cost model counts, and the runtime's NF4 experts.

The cost model's arithmetic for one MoE layer is written out here (every expert in memory, the top-k in compute);
its activation bytes are checked against what autograd keeps (runtime.memory.kept_bytes). NF4Experts must compute
what transformers' experts compute with the dequantized weights, keep back-propagating after an eval forward, and
an nf4 pipeline of a tiny Qwen3-MoE must train on three stages. Full-precision training of each MoE family against
transformers+peft is tests/unit/test_families.py.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from plans import _repeating_data, make_plan, run_in_threads
from tiny_families import COMMON, TINY
from transformers import AutoModelForCausalLM

from hetero.compiler.fxgraph import build_config
from hetero.compiler.trace import trace
from hetero.families import family
from hetero.runtime.pretrained import resolve_dir
from hetero.runtime.run.data import StepBatches
from hetero.runtime.stage.experts import NF4Experts
from hetero.runtime.stage.model import build_stage
from hetero.runtime.stage.weights import quantize_nf4
from hetero.specs import LoraSpec, ModelSpec

CPU = torch.device("cpu")
MOE = ["qwen3_moe", "mixtral", "gpt_oss"]
EVERY_MOE = sorted(t for t in TINY if family(t).experts is not None)


def arch(model_type: str, **more: object) -> dict:
    """The tiny ``model_type`` of tests/unit/test_families.py, with ``more`` (its layer kinds cut to its layers)."""
    found = {**COMMON, **TINY[model_type], **more}
    if "layer_types" in found and "layer_types" not in more:
        found["layer_types"] = found["layer_types"][:found["num_hidden_layers"]]
    return found


def spec(model_type: str, **more: object) -> ModelSpec:
    return ModelSpec(name=f"tiny-{model_type}", architecture=arch(model_type, **more), dtype="float32", seq_len=64,
                     lora=LoraSpec(r=8, alpha=16, target_modules=list(family(model_type).lora_targets_of(arch(model_type)))))


@pytest.mark.parametrize(("model_type", "width"), [("qwen2_moe", 48), ("glm4_moe", 32), ("deepseek_v2", 32),
                                                   ("deepseek_v3", 32), ("llama4_text", 32), ("qwen3_moe", 0)])
def test_the_shared_experts_every_token_runs_are_priced(model_type: str, width: int) -> None:
    """A shared expert (Qwen2-MoE's gated one, GLM-4.5's and DeepSeek's n_shared_experts, Llama 4's in its
    feed_forward block) is a plain MLP beside the routed experts: its width reaches the layer's kept bytes."""
    from hetero.compiler.costs import layer_moe

    config = build_config(arch(model_type, num_hidden_layers=2, first_k_dense_replace=0))
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    moe = layer_moe(config, dict(layer.named_parameters(prefix="model.layers.0.")))
    assert moe is not None and moe.shared == width
    assert moe.shared_gated == (model_type == "qwen2_moe")


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_routers_transformers_keeps_in_fp32_stay_fp32_on_a_bf16_stage(model_type: str, tiny_spec: ModelSpec,
                                                                      tiny_cache: Path) -> None:
    """transformers keeps these families' routers (and correction biases) in fp32 whatever the dtype: rounded to
    bf16 they would route tokens to other experts than the model was trained with."""
    from hetero.runtime.stage.model import StageLayout, _build_config, _skeleton
    from hetero.runtime.stage.weights import load_weights

    architecture = arch(model_type)
    model_dir = resolve_dir(replace(tiny_spec, name=f"tiny-{model_type}", architecture=architecture))
    model = _skeleton(_build_config(architecture), StageLayout(True, [0, 1, 2], False, False))
    load_weights(model, model_dir, torch.bfloat16, 0, False, family(model_type))
    dtypes = {name: t.dtype for name, t in model.state_dict().items() if not name.endswith("inv_freq")}
    kept = {name for name in dtypes if name.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    assert kept and all(dtypes[name] == torch.float32 for name in kept)
    assert all(dtype == torch.bfloat16 for name, dtype in dtypes.items() if name not in kept)
    h = model.model.embed_tokens(torch.randint(3, 500, (2, 16)))  # a bf16 step runs through the fp32 routers
    positions = torch.arange(16).expand(2, 16)
    rope = model.model.rotary_emb(h, positions)
    for layer in model.model.layers.values():
        h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
        h = h[0] if isinstance(h, tuple) else h
    assert h.dtype == torch.bfloat16 and torch.isfinite(h.float()).all()


def test_a_moe_layer_counts_every_expert_in_memory_and_the_top_k_in_compute() -> None:
    """Qwen3-MoE, hidden 64, 8 experts of intermediate 32, top-2; attention 4 query and 2 key-value heads of 16."""
    node = trace(spec("qwen3_moe", num_hidden_layers=1)).nodes[1]
    h, experts, inter, top_k, seq = 64, 8, 32, 2, 64
    per_expert = 3 * h * inter  # gate and up [32, 64], down [64, 32]
    attention_linears = h * 64 + 2 * h * 32 + 64 * h  # q, k, v, o
    router = experts * h
    norms = 2 * h + 2 * 16  # input and post-attention norms, q and k norms
    assert node.expert_params == experts * per_expert == 49_152
    assert node.num_params == attention_linears + experts * per_expert + router + norms
    assert node.linear_params == attention_linears + experts * per_expert  # nf4 quantizes every expert
    attention_scores = 2 * 2 * 4 * 16 * (seq + 1) / 2  # QK^T and PV, causal
    lora = 2 * 8 * ((h + 64) + 2 * (h + 32) + (64 + h))
    forward = 2 * attention_linears + 2 * router + top_k * 2 * per_expert + attention_scores + lora
    assert node.fwd_flops_per_token == pytest.approx(forward)
    dense = trace(spec("qwen3_moe", num_hidden_layers=1, num_experts_per_tok=8)).nodes[1]
    assert dense.fwd_flops_per_token - node.fwd_flops_per_token == pytest.approx((8 - 2) * 2 * per_expert)
    assert dense.expert_params == node.expert_params  # memory: every expert either way
    # Routing traffic (fp32): gather, weight, reorder and sum the rows (2 + 7k) H, and the sort's int64 keys.
    assert node.dispatch_bytes_per_token == 4 * (2 + 7 * top_k) * h + 4 * 8 * top_k


def test_the_roofline_adds_the_routing_traffic_to_a_moe_layer() -> None:
    from hetero.config import load
    from hetero.planner.model.cost_model import RooflineCostModel

    model = spec("qwen3_moe", num_hidden_layers=1)
    graph = trace(model)
    device = load(["hardware=homelab"]).cluster.devices[0]
    node = graph.nodes[1]
    bare = replace(graph, nodes=[*graph.nodes[:1], replace(node, dispatch_bytes_per_token=0.0), *graph.nodes[2:]])
    tokens = 4096
    routed = RooflineCostModel().node_time_s(graph, model, 1, device, tokens)
    unrouted = RooflineCostModel().node_time_s(bare, model, 1, device, tokens)
    dispatch = node.dispatch_bytes_per_token * tokens / (device.memory_bandwidth_gbs * 1e9)
    assert routed[0] - unrouted[0] == pytest.approx(dispatch)
    assert routed[1] - unrouted[1] == pytest.approx(2 * dispatch)


@pytest.mark.parametrize(("model_type", "experts"), [(m, e) for m in EVERY_MOE for e in ("grouped", "eager")
                                                     if e == "grouped" or not family(m).experts.scaled_input])
def test_a_moe_layer_keeps_what_the_graph_predicts(model_type: str, experts: str) -> None:
    from plans import kept_per_token

    from hetero.runtime.stage.attention import implementation, register
    from hetero.runtime.stage.model import Stage, StageLayout
    from hetero.runtime.stage.routed import use_routed

    architecture = arch(model_type, num_hidden_layers=2, first_k_dense_replace=0)  # GLM-4.5: both layers routed
    torch.manual_seed(0)
    config = build_config(architecture, experts=experts)
    register()  # the attention a stage runs (gpt-oss: hetero's eager with its sinks)
    config._attn_implementation = implementation(config._attn_implementation)
    # bfloat16, as trained (in float32 the norms' fp32 upcast that the graph counts costs nothing)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.model.layers = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(model.model.layers)})
    model.requires_grad_(False)
    moe = family(model_type).experts
    if moe.scaled_input:  # as a stage runs it: the chosen experts only (runtime/stage/routed.py)
        use_routed(model, moe.module, grouped=True)
    from peft import LoraConfig, get_peft_model

    from hetero.runtime.stage.lora import share_lora_inputs

    targets = list(family(model_type).lora_targets_of(architecture))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    peft.train()
    share_lora_inputs(peft)
    stage = Stage(1, CPU, torch.bfloat16, StageLayout(False, [0, 1], False, False), model, peft, "none")
    measured = kept_per_token(stage, architecture["hidden_size"], seq=32)
    graph = trace(replace(spec(model_type, num_hidden_layers=1, first_k_dense_replace=0), seq_len=32,
                          dtype="bfloat16", experts_implementation=experts))
    predicted = graph.nodes[1].activation_bytes_per_token
    assert measured == pytest.approx(predicted, rel=0.10)


@pytest.mark.parametrize("experts", ["grouped", "eager"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_a_moe_block_keeps_what_its_formula_says(model_type: str, experts: str) -> None:
    """The routed MoE block alone (the layer test above dilutes it with attention): what autograd keeps per token
    against MoE.activation_bytes, in bf16, at 4x the tiny intermediate size so the gate's intermediates weigh (gpt-oss's
    clamped SwiGLU keeps twice SwiGLU's). Families with shared experts add a dense MLP the layer counts."""
    from hetero.compiler.costs import layer_moe
    from hetero.runtime.stage.memory import kept_bytes

    config = build_config(arch(model_type, num_hidden_layers=1, moe_intermediate_size=128,
                               intermediate_size=128), experts=experts)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.requires_grad_(False)
    mlp = model.model.layers[0].mlp
    kept = {}
    for tokens in (64, 128):
        x = torch.randn(1, tokens, 64, dtype=torch.bfloat16)
        kept[tokens] = kept_bytes(lambda x=x: mlp(x.clone().requires_grad_()))
    measured = (kept[128] - kept[64]) / 64
    params = {f"model.layers.0.mlp.{n}": p for n, p in mlp.named_parameters()}
    predicted = layer_moe(config, params).activation_bytes(2)
    assert measured == pytest.approx(predicted, rel=0.10)


def _dequantized(layer: torch.nn.Module, quantized: NF4Experts) -> torch.nn.Module:
    """``layer``'s experts with the weights NF4Experts dequantizes (what they compute with)."""
    import bitsandbytes.functional as bnbf

    def weight(q: torch.nn.Module) -> torch.Tensor:
        return bnbf.dequantize_4bit(q.weight.data, q.weight.quant_state).to(torch.float32)

    ref = copy.deepcopy(layer)
    experts = ref.mlp.experts
    with torch.no_grad():  # gpt-oss keeps its experts input-major: NF4 holds each matrix as [out, in]
        experts.gate_up_proj.copy_(torch.stack([weight(q).t() if experts.is_transposed else weight(q)
                                                for q in quantized.gate_up]))
        experts.down_proj.copy_(torch.stack([weight(q).t() if experts.is_transposed else weight(q)
                                             for q in quantized.down]))
    return ref


@pytest.mark.parametrize("experts", ["grouped", "eager"])
@pytest.mark.parametrize("model_type", MOE)
def test_nf4_experts_compute_as_transformers_with_the_dequantized_weights(model_type: str, experts: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)  # the repacking trap (tests/unit/test_stage.py)
    torch.manual_seed(1)
    more = {"intermediate_size": 48} if model_type == "gpt_oss" else {}  # [E, H, 2I] not square: a transpose shows
    config = build_config(arch(model_type, num_hidden_layers=2, **more), experts=experts)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.model.layers = torch.nn.ModuleDict({"0": model.model.layers[0]})
    model.requires_grad_(False)
    hf_layer = copy.deepcopy(model.model.layers["0"])
    assert quantize_nf4(model, torch.float32, CPU, family(model_type).experts) == 1 + 4  # the experts, q/k/v/o
    layer = model.model.layers["0"]
    assert isinstance(layer.mlp.experts, NF4Experts) and len(layer.mlp.experts.gate_up) == config.num_experts
    assert layer.mlp.experts.grouped == (experts == "grouped")
    packed = sum(q.weight.numel() * q.weight.element_size() for q in [*layer.mlp.experts.gate_up,
                                                                        *layer.mlp.experts.down])
    assert packed == hf_layer.mlp.experts.gate_up_proj.numel() // 2 + hf_layer.mlp.experts.down_proj.numel() // 2
    ref = _dequantized(hf_layer, layer.mlp.experts)
    ref.mlp.experts.config._experts_implementation = "eager"  # the reference: transformers' per-expert loop
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(2))

    def run(mlp: torch.nn.Module, eval_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if eval_first:  # an eval pass between training steps must not cost the input gradient
            mlp.eval()
            with torch.no_grad():
                mlp(x)
            mlp.train()
        xi = x.clone().requires_grad_(True)
        out = mlp(xi)
        out = out[0] if isinstance(out, tuple) else out  # gpt-oss: (output, router scores)
        out.pow(2).sum().backward()
        return out.detach(), xi.grad

    want, want_grad = run(ref.mlp)
    for eval_first in (False, True):
        got, got_grad = run(layer.mlp, eval_first)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert got_grad.abs().sum() > 0 and torch.allclose(got_grad, want_grad, rtol=1e-4, atol=1e-6)


def test_llama4_nf4_experts_compute_as_transformers_block_with_the_dequantized_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4's experts in NF4: stored input-major ([E, H, 2I]), quantized per expert matrix as [out, in], run on
    the chosen tokens only with their inputs scaled by the router (runtime/stage/routed.py); against transformers'
    block (every expert on every token) holding the dequantized weights: output and input gradient."""
    import bitsandbytes.functional as bnbf
    import bitsandbytes.nn.modules as bnb_modules

    from hetero.runtime.stage.routed import use_routed

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)  # the repacking trap (tests/unit/test_stage.py)
    moe = family("llama4_text").experts
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(build_config(arch("llama4_text", num_hidden_layers=1, intermediate_size=48)),
                                             dtype=torch.float32)
    model.model.layers = torch.nn.ModuleDict({"0": model.model.layers[0]})
    model.requires_grad_(False)
    ref = copy.deepcopy(model.model.layers["0"].feed_forward)
    use_routed(model, moe.module, grouped=True)
    quantize_nf4(model, torch.float32, CPU, moe)
    block = model.model.layers["0"].feed_forward
    assert isinstance(block.experts, NF4Experts) and len(block.experts.gate_up) == 4
    with torch.no_grad():  # the reference holds what NF4 computes with, transposed back to transformers' layout
        for fused, parts in ((ref.experts.gate_up_proj, block.experts.gate_up), (ref.experts.down_proj,
                                                                                  block.experts.down)):
            fused.copy_(torch.stack([bnbf.dequantize_4bit(q.weight.data, q.weight.quant_state).t() for q in parts]))
        ref.shared_expert.load_state_dict({k: v for k, v in _plain_state(block.shared_expert).items()})
        ref.router.weight.copy_(block.router.weight)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(2))
    want, want_grad = _forward_backward(ref, x)
    got, got_grad = _forward_backward(block, x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got_grad.abs().sum() > 0 and torch.allclose(got_grad, want_grad, rtol=1e-4, atol=1e-5)


def _plain_state(mlp: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An MLP's weights as plain tensors (its Linears dequantized where NF4)."""
    import bitsandbytes.functional as bnbf

    out = {}
    for name, sub in mlp.named_children():
        w = getattr(sub, "weight", None)
        if w is None:
            continue  # the activation
        out[f"{name}.weight"] = (bnbf.dequantize_4bit(w.data, w.quant_state) if hasattr(w, "quant_state")
                                 else w.data).float()
    return out


class _HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values to the host (on a GPU each waits for the device), and every
    torch call (a proxy for kernel launches)."""

    SYNCS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.unique, torch.unique}

    def __init__(self) -> None:
        super().__init__()
        self.syncs = self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.syncs += func in self.SYNCS or (func is torch.where and len(args) + len(kwargs or {}) == 1)
        return func(*args, **(kwargs or {}))


def _moe_mlp(model_type: str, experts: str, nf4: bool = False, **more: object) -> torch.nn.Module:
    """The MoE block of a one-layer tiny ``model_type`` (seed 3: the same weights for every ``experts``; "sorted":
    the dense experts over sorted rows that a stage without a fast grouped GEMM runs)."""
    from hetero.runtime.stage.experts import SORTED, register_sorted
    from hetero.runtime.stage.routed import use_routed

    torch.manual_seed(3)
    moe = family(model_type).experts
    assert moe is not None
    scaled = moe.scaled_input  # Llama 4: "eager" is transformers' block (every expert for every token)
    config = build_config(arch(model_type, num_hidden_layers=2, first_k_dense_replace=0, **more),
                          experts="grouped" if experts == "sorted" or scaled else experts)
    if experts == "sorted" and not scaled:
        register_sorted()
        config._experts_implementation = SORTED
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.model.layers = torch.nn.ModuleDict({"0": model.model.layers[0]})
    model.requires_grad_(False)
    if nf4:
        quantize_nf4(model, torch.float32, CPU, moe)
    if scaled and experts != "eager":
        assert use_routed(model, moe.module, grouped=experts == "grouped") == 1
    return model.model.layers["0"].get_submodule(moe.module.rpartition(".")[0])


def _forward_backward(mlp: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xi = x.clone().requires_grad_(True)
    out = mlp(xi)
    out = out[0] if isinstance(out, tuple) else out
    out.pow(2).sum().backward()
    return out.detach(), xi.grad


@pytest.mark.parametrize("model_type", EVERY_MOE)
def test_grouped_experts_compute_as_transformers_per_expert_loop(model_type: str) -> None:
    """model.experts_implementation=grouped (the default: transformers' grouped_mm, or the sorted rows where a device
    has no fast grouped GEMM) against transformers' eager loop, in fp32: the block's output and its input gradient
    (the experts are frozen; the router's weights reach the loss through both)."""
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(4))
    want, want_grad = _forward_backward(_moe_mlp(model_type, "eager"), x)
    for experts in ("grouped", "sorted"):
        got, got_grad = _forward_backward(_moe_mlp(model_type, experts), x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), experts
        assert got_grad.abs().sum() > 0 and torch.allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6), experts


@pytest.mark.parametrize("nf4", [False, True], ids=["dense-experts", "nf4-experts"])
def test_grouped_experts_read_to_the_host_at_most_once_per_layer(nf4: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager loop waits for the device once per used expert (and launches ~10 kernels per expert); grouped
    experts read nothing back (dense: torch's grouped matmul) or the expert counts once (NF4, and dense weights on
    a device without a fast grouped GEMM: a loop over the used experts' rows), and launch a number of kernels that
    does not grow with the experts for dense weights."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)  # the repacking trap (tests/unit/test_stage.py)
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(5))
    counted = {}
    for experts, count in (("eager", 8), ("grouped", 8), ("grouped", 32), ("sorted", 8), ("sorted", 32)):
        mlp = _moe_mlp("qwen3_moe", experts, nf4, num_experts=count)
        with _HostSyncs() as mode:
            mlp(x)
        counted[experts, count] = mode
    assert counted["eager", 8].syncs >= 8
    assert counted["grouped", 8].syncs == counted["grouped", 32].syncs == (1 if nf4 else 0)
    assert counted["sorted", 8].syncs == counted["sorted", 32].syncs == 1
    if not nf4:
        assert counted["grouped", 32].calls == counted["grouped", 8].calls < counted["eager", 8].calls


@pytest.mark.slow
def test_a_moe_pipeline_in_nf4_trains_on_three_stages(tiny_spec: ModelSpec, tiny_cache: Path, tmp_path: Path) -> None:
    from hetero.specs import TrainSpec

    architecture = arch("qwen3_moe")
    model_dir = resolve_dir(replace(tiny_spec, name="tiny-qwen3_moe", architecture=architecture))
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=6, lr=1e-2, max_grad_norm=1.0, shuffle=False)
    lora = LoraSpec(r=4, alpha=8.0, target_modules=list(family("qwen3_moe").lora_targets))
    plan = make_plan(model_dir, architecture, [2, 2, 2], train=train, lora=lora, quantization="nf4", seq_len=24)
    plan = replace(plan, data=_repeating_data(tmp_path, 4))
    stages = [build_stage(plan, k, CPU) for k in range(3)]
    for st in stages:
        assert all(isinstance(st.model.model.layers[str(i)].mlp.experts, NF4Experts) for i in st.layout.layers)
    losses = run_in_threads(stages, plan, StepBatches(plan.data, model_dir, 24, 2, 2, 0, False), train.steps)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("hardware", ["homelab", "mining_rig"])
@pytest.mark.parametrize(("preset", "layers", "experts", "hidden", "inter"),
                         [("qwen3_30b_a3b", 48, 128, 2048, 768), ("mixtral_8x7b", 32, 8, 4096, 14336),
                          ("gpt_oss_120b", 36, 128, 2880, 2880)])
def test_moe_presets_compile_in_nf4_and_show_their_experts(preset: str, layers: int, experts: int, hidden: int,
                                                           inter: int, hardware: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from cli_calls import run_main

    from hetero.plan import Plan
    from hetero.specs import QUANT_BYTES_PER_PARAM

    out = tmp_path / "out"
    code, _, err = run_main(["compile", f"model={preset}", "model.quantization=nf4", f"hardware={hardware}",
                             f"output={out}"], capsys)
    assert code == 0, err
    plan = Plan.load(out / "plan.json")
    nf4_experts = layers * experts * 3 * hidden * inter * QUANT_BYTES_PER_PARAM["nf4"] / 1e9
    # One pipeline holds every expert once (replicas each hold their own copy).
    one_pipeline = [plan.stages[k] for k in plan.pipelines[0].stages]
    assert sum(s.memory.experts_gb for s in one_pipeline) == pytest.approx(nf4_experts, rel=1e-6)
    assert all(s.memory.experts_gb < s.memory.weights_gb for s in plan.stages)
    code, shown, err = run_main(["show", str(out / "plan.json"), "--no-gantt"], capsys)
    assert code == 0, err
    assert "of which experts" in shown
    # ... and what their prediction rests on: experts priced at the matmul rate run slower than that.
    assert "This model routes each token to a few experts" in " ".join(shown.split()), shown
    if preset == "gpt_oss_120b":  # what the stages hold: the hub's MXFP4 experts, dequantized, then NF4
        assert "store the experts in MXFP4; each stage dequantizes them while loading and quantizes them again to " \
               "NF4" in " ".join(shown.split()), shown


def test_lora_on_a_router_or_the_experts_is_refused_in_one_line() -> None:
    from hetero.errors import ConfigError

    for target in ("gate", "experts"):
        base = spec("qwen3_moe", num_hidden_layers=1)
        bad = replace(base, lora=replace(base.lora, target_modules=["q_proj", target]))
        with pytest.raises(ConfigError, match=rf"names '{target}', a Qwen3Moe\w+ in this qwen3_moe model, not a "
                           r"Linear layer LoRA can wrap \(a mixture of experts' router and experts get no LoRA"):
            trace(bad)
    base = spec("llama4_text", num_hidden_layers=1)  # Llama 4's router subclasses Linear, yet returns two tensors
    with pytest.raises(ConfigError, match=r"names 'router', a Llama4Router in this llama4_text model, not a Linear "):
        trace(replace(base, lora=replace(base.lora, target_modules=["q_proj", "router"])))


def test_a_router_loss_asked_for_is_refused_in_one_line() -> None:
    """Stages never run the CausalLM forward where transformers adds the router's auxiliary loss: asking for it
    would be silently ignored, so compile refuses it."""
    from hetero.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.architecture.output_router_logits is true: hetero trains this "
                       r"mixtral model without the router's auxiliary load-balancing loss; set it to false$"):
        trace(spec("mixtral", num_hidden_layers=1, output_router_logits=True))


def test_the_experts_implementation_is_an_option_checked_in_one_line(tmp_path: Path) -> None:
    """model.experts_implementation: grouped (the default, outside the plan's hash: plans from before keep theirs)
    or eager; anything else is one line naming the choices."""
    import json

    from hetero.config import load
    from hetero.errors import ConfigError
    from hetero.plan import Plan, compute_input_hash

    with pytest.raises(ConfigError, match=r"^model.experts_implementation must be one of grouped, eager, got 'loop'$"):
        load(["model=qwen3_30b_a3b", "model.experts_implementation=loop"])
    assert load(["model=qwen3_30b_a3b"]).model.experts_implementation == "grouped"
    assert load(["model=qwen3_30b_a3b", "model.experts_implementation=eager"]).model.experts_implementation == "eager"
    # A model file without the key (a dense preset) says how to add it.
    with pytest.raises(ConfigError, match=r"^'model.experts_implementation' is not in this model file: add it with "
                       r"\+model.experts_implementation=<value>$"):
        load(["model=llama8b", "model.experts_implementation=eager"])
    assert load(["model=llama8b", "+model.experts_implementation=eager"]).model.experts_implementation == "eager"
    from plans import make_plan as plan_of

    plan = plan_of(tmp_path, arch("qwen3_moe"), [2, 2, 2])
    eager = replace(plan, model=replace(plan.model, experts_implementation="eager"))
    assert compute_input_hash(eager) != compute_input_hash(plan)
    plan = replace(plan, input_hash=compute_input_hash(plan))
    plan.save(tmp_path / "plan.json")
    old = json.loads((tmp_path / "plan.json").read_text())
    del old["model"]["experts_implementation"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.load(tmp_path / "old.json").input_hash == plan.input_hash


def test_gpt_oss_experts_load_from_mxfp4(tmp_path: Path) -> None:
    """gpt-oss's hub checkpoints store the experts in MXFP4 (``*_blocks``: 4-bit codes two per byte, low nibble
    first; ``*_scales``: a biased power-of-two exponent per 32 inputs, per output row). A stage loads them as the
    bf16 tensors [E, in, out] transformers' experts hold: here from codes and exponents drawn at random, written
    the way the hub lays them out, against the values they encode."""
    from safetensors.torch import load_file, save_file

    from hetero.runtime.stage.weights import FP4_VALUES, load_weights

    config = build_config(arch("gpt_oss", num_hidden_layers=2))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    expected = {}
    for name in [n for n in state if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        experts, inputs, outputs = state.pop(name).shape
        codes = torch.randint(0, 16, (experts, outputs, inputs // 32, 32), generator=gen, dtype=torch.uint8)
        exponents = torch.randint(120, 131, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
        values = torch.tensor(FP4_VALUES)[codes.long()] * 2.0 ** (exponents.float() - 127).unsqueeze(-1)
        expected[name] = values.reshape(experts, outputs, inputs).transpose(1, 2)
        state[f"{name}_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        state[f"{name}_scales"] = exponents
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    load_weights(model, tmp_path, torch.bfloat16, 0, tied=False, fam=family("gpt_oss"))
    loaded = dict(model.named_parameters())
    assert len(expected) == 4
    for name, want in expected.items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name].float(), want), name
    from hetero.errors import CheckpointError
    from hetero.runtime.stage.weights import dequantize_mxfp4

    with pytest.raises(CheckpointError, match=r"^'x': MXFP4 blocks \(4, 8, 2, 16\) and scales \(4, 8, 3\) do not match"):
        dequantize_mxfp4(torch.zeros(4, 8, 2, 16, dtype=torch.uint8), torch.zeros(4, 8, 3, dtype=torch.uint8), "x")


def test_gpt_oss_refuses_what_it_cannot_compute_in_one_line() -> None:
    """gpt-oss's attention sinks need eager attention: anything else would train another model, so compile refuses
    it in one line."""
    from hetero.errors import ConfigError

    for choice in ("sdpa", "flash_attention_2", "flex_attention"):
        with pytest.raises(ConfigError, match=rf"^model.attn_implementation={choice}: this gpt_oss model adds a learned "
                           r"sink logit to every attention softmax, which only eager attention computes"):
            trace(replace(spec("gpt_oss", num_hidden_layers=2), attn_implementation=choice))


def test_a_device_without_a_fast_grouped_gemm_runs_the_sorted_rows() -> None:
    """transformers' grouped_mm falls back, off CPU and Ampere+ bf16, to an op that computes the frozen experts'
    weight gradients: such a stage runs the experts over sorted rows instead (the config its stage builds says so)."""
    from hetero.runtime.stage.experts import SORTED, grouped_fast
    from hetero.runtime.stage.model import _build_config

    assert grouped_fast(CPU, torch.bfloat16) and grouped_fast(CPU, torch.float32)
    assert not grouped_fast(torch.device("cuda"), torch.float16)  # Volta/Turing train in fp16: no grouped GEMM
    assert not grouped_fast(torch.device("cuda"), torch.float32)
    assert not grouped_fast(torch.device("mps"), torch.bfloat16)
    assert _build_config(arch("qwen3_moe"), "auto", CPU, torch.float32)._experts_implementation == "grouped_mm"
    fp16 = _build_config(arch("qwen3_moe"), "auto", torch.device("cuda"), torch.float16)
    assert fp16._experts_implementation == SORTED
    assert _build_config(arch("qwen3_moe"), "auto", torch.device("cuda"), torch.float16,
                         "eager")._experts_implementation == "eager"
