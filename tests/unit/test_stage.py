"""Stage building: own weights only, whole-model names, exact forward, nf4 that still back-propagates."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from plans import _repeating_data, make_plan, run_in_threads
from reference import build_reference_model, make_init_adapter
from transformers import AutoModelForCausalLM

from hetero.errors import CheckpointError, PlanError
from hetero.plan import Plan
from hetero.runtime.run.data import StepBatches
from hetero.runtime.stage import weights as weights_module
from hetero.runtime.stage.lora import LoraLinear
from hetero.runtime.stage.model import build_stage
from hetero.specs import LoraSpec, ModelSpec, TrainSpec

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_init_adapter(tiny_model_dir, LoraSpec(r=4, alpha=8.0), tmp_path_factory.mktemp("a") / "ad", seed=5)


@pytest.fixture(scope="module")
def sharded_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model re-saved as many safetensors shards (like a real 8B checkpoint)."""
    out = tmp_path_factory.mktemp("sharded")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.save_pretrained(str(out), max_shard_size="60KB")
    return out


def test_chained_stages_equal_the_whole_peft_model(sharded_dir: Path, adapter: Path, tiny_spec: ModelSpec,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    lora = LoraSpec(r=4, alpha=8.0, init_from=str(adapter))
    plan = make_plan(sharded_dir, tiny_spec.architecture, [1, 3, 2], lora=lora)
    opened: list[list[str]] = []
    real_open = weights_module.__dict__.get("safe_open")
    import safetensors

    original = safetensors.safe_open

    def spy(path, *a, **kw):  # record which shard files each stage opens
        opened[-1].append(Path(path).name)
        return original(path, *a, **kw)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    stages = []
    for k in range(3):
        opened.append([])
        stages.append(build_stage(plan, k, CPU))
    assert real_open is None  # the stage imports safe_open lazily, so the spy above sees every open

    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    for k, st in enumerate(stages):
        names = set(st.model.state_dict()) - {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
        base_names = {n.replace("base_layer.", "") for n in names if "lora_" not in n}
        # Only this stage's tensors, and only the shard files that hold them.
        assert {Path(index[n]).name for n in base_names} == set(opened[k]) or not opened[k]
        assert len(set(opened[k])) == len(opened[k])
        assert all(not p.is_meta for p in st.model.parameters())
        assert not st.model.model.rotary_emb.inv_freq.is_meta
    assert [st.layout.layers for st in stages] == [[0], [1, 2, 3], [4, 5]]
    assert stages[1].model.model.embed_tokens is None and stages[1].model.lm_head is None
    assert len(set(opened[0]) & set(opened[2])) <= 1  # the first and last stage share at most a boundary shard

    reference = build_reference_model(sharded_dir, LoraSpec(r=4, alpha=8.0), adapter)
    union = {}
    for st in stages:
        union.update(st.lora_state())
    from peft import get_peft_model_state_dict

    ref_state = get_peft_model_state_dict(reference)
    assert set(union) == set(ref_state)  # the stages' states are in whole-model key space
    for key, value in ref_state.items():
        assert torch.equal(union[key], value), key

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = ids
        for st in stages:
            h = st.forward(h)
        want = reference(input_ids=ids).logits
    assert torch.allclose(h, want, atol=1e-5, rtol=1e-5)


def test_bad_adapter_and_bad_span_are_one_line_errors(tiny_model_dir: Path, tiny_spec: ModelSpec, adapter: Path) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], lora=LoraSpec(r=8, init_from=str(adapter)))
    with pytest.raises(CheckpointError, match="r=4 but the plan has lora.r=8"):
        build_stage(plan, 0, CPU)
    with pytest.raises(PlanError, match="stage 5 does not exist"):
        build_stage(plan, 5, CPU)


def test_plan_recompute_layers_reach_the_stage(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], recompute="full")
    stage = build_stage(plan, 1, CPU)
    assert stage.recompute == frozenset(stage.layout.layers) == frozenset({3, 4, 5})
    lora_layers = [m for m in stage.model.modules() if isinstance(m, LoraLinear)]
    assert len(lora_layers) == 7 * 3  # every LoRA Linear runs through runtime/stage/lora.py
    other = replace(plan.stages[1], recompute_layers=["layers.0"])  # a layer of another stage
    plan = replace(plan, stages=[plan.stages[0], other, *plan.stages[2:]])
    with pytest.raises(PlanError, match="recompute_layers names 'layers.0'"):
        build_stage(plan, 1, CPU)


def _nf4_plan(model_dir: Path, spec: ModelSpec, tmp_path: Path, recompute: str = "none") -> tuple:
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=6, lr=1e-2, max_grad_norm=1.0, shuffle=False)
    plan = make_plan(model_dir, spec.architecture, [2, 2, 2], train=train, quantization="nf4", seq_len=24,
                     recompute=recompute)
    plan = replace(plan, data=_repeating_data(tmp_path, 4))
    return plan, StepBatches(plan.data, model_dir, 24, 2, 2, 0, False)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_nf4_pipeline_trains_and_every_lora_matrix_gets_gradient(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                 tmp_path: Path, recompute: str) -> None:
    import bitsandbytes as bnb

    plan, batches = _nf4_plan(tiny_model_dir, tiny_spec, tmp_path, recompute)
    stages = [build_stage(plan, k, CPU) for k in range(3)]
    for st in stages:
        linears = [m for m in st.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(linears) == 7 * len(st.layout.layers)  # every decoder Linear is NF4
        assert all(m.weight.quant_type == "nf4" and m.support_avx512bf16_for_cpu is False for m in linears)
    zero_grads: list[str] = []

    def check(k: int, executor) -> None:
        if executor.steps_done == 0:
            return  # lora_B starts at zero, so lora_A's first gradient is zero by construction
        for name, p in executor.stage.lora_named_parameters():
            if p.grad is None or p.grad.abs().sum() == 0:
                zero_grads.append(f"stage{k}:{name}")

    losses = run_in_threads(stages, plan, batches, plan.train.steps, on_step=check)
    assert zero_grads == []
    assert losses[-1] < losses[0] - 0.05, losses


def test_nf4_eval_forward_does_not_break_training_on_avx512bf16_cpus(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes repacks NF4 weights for AVX512-BF16 CPUs on an eval-mode forward; after that the
    backward pass computes wrong (or no) input gradients. Pretend this CPU has the feature."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    plan, batches = _nf4_plan(tiny_model_dir, tiny_spec, tmp_path)
    hidden = torch.randn(2, 16, int(tiny_spec.architecture["hidden_size"]), generator=torch.Generator().manual_seed(1))

    def input_grad(eval_first: bool) -> torch.Tensor:
        st = build_stage(plan, 1, CPU)
        if eval_first:  # e.g. a validation or generation pass between training steps
            st.lora_model.eval()
            with torch.no_grad():
                st.forward(hidden)
            st.lora_model.train()
        x = hidden.clone().requires_grad_(True)
        st.forward(x).pow(2).sum().backward()
        return x.grad

    clean, after_eval = input_grad(False), input_grad(True)
    assert clean.abs().sum() > 0
    assert torch.allclose(after_eval, clean, rtol=1e-5, atol=1e-6)


def test_mixed_dtype_stages_cast_on_arrival(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    """A bfloat16 stage feeds float32 stages (and gets float32 gradients back): training still matches fp32."""
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=2, lr=1e-3, shuffle=False)
    losses = {}
    for name, dtypes in {"fp32": None, "mixed": ["float32", "bfloat16", "float32"]}.items():
        plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2], train=train, seq_len=24, dtypes=dtypes)
        plan = replace(plan, data=_repeating_data(tmp_path, 4))
        batches = StepBatches(plan.data, tiny_model_dir, 24, 2, 2, 0, False)
        stages = [build_stage(plan, k, CPU) for k in range(3)]
        assert stages[1].dtype == (torch.bfloat16 if dtypes else torch.float32)
        losses[name] = run_in_threads(stages, plan, batches, train.steps)
    assert losses["mixed"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_trained_adapter_loads_with_peft(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    """The union of stage states saved by save_adapter is a standard PEFT adapter."""
    from hetero.runtime.stage.adapter import save_adapter

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3])
    stages = [build_stage(plan, k, CPU) for k in range(2)]
    with torch.no_grad():
        for st in stages:
            for _, p in st.lora_named_parameters():
                p.add_(0.01)
    state = {}
    for st in stages:
        state.update(st.lora_state())
    save_adapter(state, plan.model.lora, str(tiny_model_dir), tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        h = ids
        for st in stages:
            h = st.forward(h)
    assert torch.allclose(h, want, atol=1e-5)


_STAGE_IMPORTS = """
import json, sys
import torch, transformers
import hetero.runtime.stage.process  # what a stage process imports before building
from hetero.plan import Plan
from hetero.runtime.stage.model import build_stage
seen = {}
for name in sys.argv[1:]:
    build_stage(Plan.load(name), 0, torch.device("cpu"))
    seen[name] = [m for m in ("peft", "bitsandbytes") if m in sys.modules]
print(json.dumps(seen))
"""


def test_a_stage_process_imports_neither_peft_nor_unused_bitsandbytes(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                                       tmp_path: Path) -> None:
    """peft costs seconds of CPU at every stage's start: a stage builds LoRA without it, and imports
    bitsandbytes only to quantize (the nf4 build shows the check sees an import when there is one)."""
    paths = []
    for quantization in ("none", "nf4"):
        paths.append(str(tmp_path / f"{quantization}.json"))
        make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], quantization=quantization).save(paths[-1])
    done = subprocess.run([sys.executable, "-c", _STAGE_IMPORTS, *paths], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {paths[0]: [], paths[1]: ["bitsandbytes"]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_gpu_bf16_nf4_stage_feeds_a_cpu_stage(tiny_model_dir: Path, tiny_spec: ModelSpec, tmp_path: Path) -> None:
    """A bf16 NF4 stage on the GPU and an fp32 CPU stage train together; every LoRA matrix learns."""
    train = TrainSpec(micro_batch_size=2, num_micro_batches=2, steps=4, lr=1e-2, shuffle=False)
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=train, seq_len=24, quantization="nf4",
                     dtypes=["bfloat16", "float32"])
    plan = replace(plan, data=_repeating_data(tmp_path, 4))
    batches = StepBatches(plan.data, tiny_model_dir, 24, 2, 2, 0, False)
    stages = [build_stage(plan, 0, torch.device("cuda", 0)), build_stage(plan, 1, CPU)]
    assert all(p.is_cuda for p in stages[0].model.parameters())
    losses = run_in_threads(stages, plan, batches, train.steps)
    assert losses[-1] < losses[0]


def test_make_plan_round_trips_through_plan_json(tmp_path: Path, tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2])
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.input_hash == plan.input_hash
    spans = [(s.first_node, s.last_node) for s in loaded.stages]
    assert spans == [(0, 2), (3, 4), (5, 8)]
    assert loaded.stages[1].node_names == ["layers.2", "layers.3"]
