"""Packing (data.packing, the default): rows hold several records, and training them equals training each alone.

The strongest checks are tests/unit/test_families.py's, where every family trains packed rows on 3 stages in float64 and
equals plain transformers+peft trained on the same records one per row (tests/reference.py) within 1e-9. Here the
same holds through `hetero run`'s processes in float32 (within 1e-5) for llama and gemma3_text (sliding windows
shorter than the records, two rotary bases): the wire and the processes are the same for every family, so gpt_oss
and deepseek_v2 (run here until 2026-12-03) are checked in one process by test_families.py.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from metrics_rows import read_metrics, step_lines
from plans import make_plan
from reference import assert_close_to_scale, reference_run, unpacked
from tiny_families import COMMON, TINY

from hetero.families import family
from hetero.packing import length_stats, pack_rows
from hetero.runtime.cli import main_run
from hetero.runtime.pretrained import resolve_dir
from hetero.runtime.run.data import IGNORE_INDEX, StepBatches
from hetero.runtime.stage.adapter import load_adapter_state
from hetero.runtime.stage.attention import implementation, register, segments_of
from hetero.specs import DataSpec, ModelSpec, TrainSpec


def test_best_fit_places_every_record_once_within_the_row() -> None:
    rng = random.Random(5)
    lengths = [min(1000, int(rng.lognormvariate(5.3, 0.8))) for _ in range(500)]
    rows = pack_rows(lengths, 1024)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 1024 for row in rows)
    # Near the bound no packing can beat: ceil(total / capacity).
    bound = -(-sum(lengths) // 1024)
    assert len(rows) <= bound * 1.02 + 1
    # The row count depends on the lengths only, not their order: every epoch has as many rows.
    shuffled = list(range(len(lengths)))
    rng.shuffle(shuffled)
    assert len(pack_rows([lengths[i] for i in shuffled], 1024)) == len(rows)
    # A record longer than a row takes a row of its own (it is truncated there).
    assert pack_rows([5, 3000, 4], 8) == [[1], [0], [2]]
    assert pack_rows([5, 3, 4, 4], 8) == [[0, 1], [2, 3]]


def test_length_stats_count_real_and_label_tokens() -> None:
    lengths, labels = [10, 20, 30, 40, 200], [5, 10, 15, 20, 100]
    stats = length_stats(lengths, labels, seq_len=64, packed=True)
    assert (stats.median, stats.longest, stats.truncated) == (30, 200, 1)
    assert stats.rows == 3  # 64 (the truncated one), 40 + 20, 30 + 10
    assert stats.efficiency == pytest.approx((10 + 20 + 30 + 40 + 64) / (3 * 64))
    padded = length_stats(lengths, labels, seq_len=64, packed=False)
    assert padded.rows == 5 and padded.efficiency == pytest.approx(164 / (5 * 64))


def _batches(model_dir: Path, **kw) -> StepBatches:
    args = {"seq_len": 128, "micro_batch_size": 2, "num_micro_batches": 3, "seed": 1, "shuffle": True} | kw
    return StepBatches(DataSpec(), model_dir, **args)


def test_packed_rows_keep_records_apart_and_count_the_same_labels(tiny_model_dir: Path) -> None:
    sb = _batches(tiny_model_dir)
    assert sb.packing and sb.rows_per_epoch < sb.num_records / 2  # the demo records are short: rows hold several
    seen: list[int] = []
    for step in range(sb.steps_per_epoch):
        batch = sb.step(step)
        assert batch.position_ids is not None
        ids, labels = batch.input_ids.view(-1, 128), batch.labels.view(-1, 128)
        positions = batch.position_ids.view(-1, 128)
        records = iter(batch.record_ids)
        for row in range(ids.shape[0]):
            segments = segments_of(positions[row:row + 1]).rows[0]
            at = 0
            for start, end in segments:
                assert start == at and positions[row, start:end].tolist() == list(range(end - start))
                at = end
                if end - start and int(ids[row, start]) == sb.pad_id and start > 0:
                    continue  # the padding after a row's last record
                index = next(records)
                seen.append(index)
                want_ids, want_labels = sb.encode(index)
                assert ids[row, start:end].tolist() == want_ids[:end - start]
                # The record's first token learns nothing from the record before it.
                assert start == 0 or int(labels[row, start]) == IGNORE_INDEX
                assert labels[row, start + 1:end].tolist() == want_labels[1:end - start]
            assert at == 128
        assert next(records, None) is None
        assert unpacked(sb, batch).num_label_tokens == batch.num_label_tokens  # asserts the same count inside
    # The first epoch's rows hold every record once (the last step runs on into the next epoch).
    first_epoch = seen[:sum(len(r) for r in sb.epoch_rows(0))]
    assert sorted(first_epoch) == list(range(sb.num_records))


def test_packed_steps_are_a_function_of_the_step_number(tiny_model_dir: Path) -> None:
    a, b = _batches(tiny_model_dir), _batches(tiny_model_dir)
    late = a.steps_per_epoch * 2 + 1  # a resumed run asks for a step of a later epoch first
    for step in (late, 0, 3):
        x, y = a.step(step), b.step(step)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.position_ids, y.position_ids)
        assert x.record_ids == y.record_ids
    assert a.step(0).record_ids != a.step(a.steps_per_epoch).record_ids  # each epoch its own order
    c = _batches(tiny_model_dir, seed=2)
    assert c.step(0).record_ids != a.step(0).record_ids


def test_packing_off_keeps_one_record_per_row(tiny_model_dir: Path) -> None:
    sb = _batches(tiny_model_dir, packing=False)
    batch = sb.step(0)
    assert batch.position_ids is None and len(batch.record_ids) == 6 and sb.rows_per_epoch == sb.num_records


FAMILIES = ["llama", "qwen3", "gemma3_text", "phi3", "qwen3_moe", "gpt_oss", "deepseek_v2"]
# Through `hetero run`'s processes (the others: tests/unit/test_families.py in float64, in one process).
RUN_FAMILIES = ["llama", "gemma3_text"]


@pytest.mark.parametrize(("model_type", "attention"), [(f, "auto") for f in FAMILIES] + [
    ("gemma2", "auto"), ("gemma2", "flex_attention"), ("gemma3_text", "eager"), ("gemma3_text", "flex_attention"),
    ("qwen3_moe", "flex_attention"), ("deepseek_v2", "eager"), ("deepseek_v2", "flex_attention"),
    ("deepseek_v3", "auto"), ("llama4_text", "auto")])
def test_a_packed_row_computes_each_record_as_alone(model_type: str, attention: str) -> None:
    """Through transformers' own model with hetero's attention: logits of a packed row equal each record's alone
    (computed by transformers' own implementation of the family), with records longer than the sliding window (16)
    and a one-token record; per-record SDPA, eager (Gemma 2's soft cap) and flex attention (forward only: on CPU
    it has no backward)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = {**COMMON, **TINY.get(model_type, {"model_type": "llama"})}
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    family(config.model_type).configure(config)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()  # transformers' own attention, one record a call
    config = copy.deepcopy(config)  # the reference keeps its own
    family(config.model_type).configure(config, attention)
    register()
    config._attn_implementation = implementation(config._attn_implementation)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(reference.state_dict())
    lengths = [40, 7, 25, 1]
    ids = torch.randint(3, 500, (1, sum(lengths) + 5))
    positions = torch.cat([torch.arange(n) for n in [*lengths, 5]]).unsqueeze(0)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, hetero_segments=segments_of(positions)).logits
        at = 0
        for n in lengths:
            alone = reference(input_ids=ids[:, at:at + n]).logits
            torch.testing.assert_close(packed[:, at:at + n], alone, rtol=0, atol=1e-5)
            at += n


@pytest.mark.parametrize(("device", "most"), [("cuda", 1.6), ("cpu", 2.5)])
def test_packed_rows_issue_about_the_operators_of_padded_rows(device: str, most: float,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU stage of a small model is bound by the operators it issues, not by arithmetic (docs/gpu.md): a packed
    micro-batch of 4 rows of 8 records each (36 segments, their padding included) must not cost a call per record
    per layer (that issued 5.2x the operators of the same rows unpacked). Forward and backward through
    transformers' Llama on this CPU, with the length buckets a GPU uses (three) and a CPU's (eight: a CPU pays
    for padded attention, not for calls); an SDPA call and its backward are about 50 operators here, a few
    kernels on CUDA."""
    import hetero.runtime.stage.attention as attention

    monkeypatch.setitem(attention.BUCKET_WASTE, "cpu", attention.BUCKET_WASTE[device])
    from torch.profiler import profile
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = {**COMMON, "model_type": "llama"}
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    family(config.model_type).configure(config)
    register()
    config._attn_implementation = implementation(config._attn_implementation)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    rng = random.Random(0)
    rows = []
    for _ in range(4):
        lengths = [rng.randint(4, 20) for _ in range(8)]
        rows.append(torch.cat([torch.arange(n) for n in lengths] + [torch.arange(128 - sum(lengths))]))
    positions = torch.stack(rows)
    ids = torch.randint(3, 500, positions.shape)

    def operators(**packed: object) -> int:
        model(input_ids=ids, **packed).logits.float().sum().backward()  # warm: first calls build caches
        with profile() as prof:
            model(input_ids=ids, **packed).logits.float().sum().backward()
        return sum(event.count for event in prof.key_averages())

    padded = operators()
    packed = operators(position_ids=positions, hetero_segments=segments_of(positions))
    assert packed <= most * padded, (packed, padded)


SEQ_LEN = 128
TRAIN = TrainSpec(micro_batch_size=2, num_micro_batches=3, steps=3, lr=2e-3, scheduler="cosine", warmup_steps=1,
                  max_grad_norm=0.05, seed=3, shuffle=True)
RTOL = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("model_type", RUN_FAMILIES)
def test_packed_training_equals_the_records_trained_alone(model_type: str, tiny_spec: ModelSpec, tiny_cache: Path,
                                                         tmp_path: Path) -> None:
    architecture = {**COMMON, **TINY.get(model_type, {"model_type": "llama"})}
    model_dir = resolve_dir(replace(tiny_spec, name=f"tiny-{model_type}", architecture=architecture))
    setup = reference_run(model_dir, tmp_path, TRAIN, SEQ_LEN, targets=list(family(model_type).lora_targets_of(architecture)))
    plan = make_plan(model_dir, architecture, [3, 3], train=TRAIN, lora=setup["lora"], seq_len=SEQ_LEN)
    assert plan.data.packing
    plan.save(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    assert main_run([str(tmp_path / "plan.json"), "--run-dir", str(run_dir), "--no-progress"]) == 0
    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    batches = StepBatches(DataSpec(), model_dir, SEQ_LEN, TRAIN.micro_batch_size, TRAIN.num_micro_batches,
                          TRAIN.seed, TRAIN.shuffle)
    assert len(batches.step(0).record_ids) > 2 * TRAIN.micro_batch_size * TRAIN.num_micro_batches  # really packed
    for m, want in zip(metrics, setup["losses"], strict=True):
        assert m["loss"] == pytest.approx(want, rel=RTOL), f"{model_type} step {m['step']}: {m['loss']} vs {want}"
    trained = load_adapter_state(run_dir / "adapter", setup["lora"])
    assert set(trained) == set(setup["state"]) and trained
    initial = load_adapter_state(Path(setup["lora"].init_from))
    for key, want in setup["state"].items():
        assert not torch.equal(initial[key], want)
        assert_close_to_scale(key, trained[key], want, RTOL)


def test_attention_choices_a_stage_cannot_run_are_one_line(tmp_path: Path) -> None:
    from hetero.cli import main
    from hetero.errors import PlanError
    from hetero.runtime.stage.attention import runtime_attention

    cpu = torch.device("cpu")
    for choice in ("flash_attention_2", "flex_attention"):
        with pytest.raises(PlanError, match=rf"^model.attn_implementation={choice}: this stage (runs on cpu|computes)"):
            runtime_attention(choice, choice, cpu, torch.float32)
        assert main(["compile", "model=tiny", "hardware=local", f"model.attn_implementation={choice}",
                     f"output={tmp_path / choice}"]) == 2
    assert runtime_attention("sdpa", "auto", cpu, torch.float32) == "sdpa"  # auto never picks a kernel it lacks
    assert main(["compile", "model=tiny", "hardware=local", "model.architecture.model_type=gemma2",
                 "model.attn_implementation=sdpa", f"output={tmp_path / 'g'}"]) == 2
    assert main(["compile", "model=tiny", "hardware=local", "model.attn_implementation=eager",
                 f"output={tmp_path / 'e'}"]) == 0


def test_attention_choice_runs_and_leaves_old_plans_hash(tiny_model_dir: Path, tiny_spec: ModelSpec,
                                                          tmp_path: Path) -> None:
    """Eager attention on packed rows gives the SDPA run's losses; `auto` keeps the hash plans had before."""
    import json

    from hetero.plan import Plan, compute_input_hash

    plans = {}
    for choice in ("auto", "eager"):
        plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=replace(TRAIN, steps=2),
                         seq_len=SEQ_LEN)
        plan = replace(plan, model=replace(plan.model, attn_implementation=choice))
        plans[choice] = plan = replace(plan, input_hash=compute_input_hash(plan))
        plan.save(tmp_path / f"{choice}.json")
        assert main_run([str(tmp_path / f"{choice}.json"), "--run-dir", str(tmp_path / choice), "--no-progress"]) == 0
    losses = {c: [m["loss"] for m in step_lines(read_metrics(tmp_path / c / "metrics.jsonl"))] for c in plans}
    assert losses["eager"] == pytest.approx(losses["auto"], rel=1e-5)
    assert plans["eager"].input_hash != plans["auto"].input_hash
    # A plan.json written before the option (no model.attn_implementation) loads, its hash unchanged.
    old = json.loads((tmp_path / "auto.json").read_text())
    del old["model"]["attn_implementation"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.load(tmp_path / "old.json").input_hash == plans["auto"].input_hash


def test_packed_attention_is_priced_at_the_records_lengths(tiny_spec: ModelSpec) -> None:
    """A decoder layer's attention FLOPs with packed records (attention_len, from the data) equal those of rows as
    long as the records, and the rest of its work is unchanged; Gemma 3's sliding layers never exceed the window."""
    from hetero.compiler.trace import trace

    long = replace(tiny_spec, seq_len=128)
    short, packed = trace(replace(tiny_spec, seq_len=40)), trace(long, attention_len=40)
    padded = trace(long)
    layer = 1
    assert packed.nodes[layer].fwd_flops_per_token == pytest.approx(short.nodes[layer].fwd_flops_per_token)
    assert packed.nodes[layer].fwd_flops_per_token < padded.nodes[layer].fwd_flops_per_token
    assert packed.nodes[-1].fwd_flops_per_token == padded.nodes[-1].fwd_flops_per_token  # the head: per token
    assert any("attention priced at the packed records' lengths" in n for n in packed.notes)
    # flex attention skips what a sliding window leaves out; per-record SDPA computes a long record's band whole.
    gemma = replace(tiny_spec, architecture={**COMMON, **TINY["gemma3_text"]}, seq_len=128,
                    lora=replace(tiny_spec.lora, target_modules=["q_proj"]), attn_implementation="flex_attention")
    wide, capped = trace(gemma, attention_len=100), trace(gemma, attention_len=31)  # window 16: causal over 31
    sliding = next(i for i, n in enumerate(wide.nodes) if n.layer_type == "sliding_attention")
    full = next(i for i, n in enumerate(wide.nodes) if n.layer_type == "full_attention")
    assert wide.nodes[sliding].fwd_flops_per_token == pytest.approx(capped.nodes[sliding].fwd_flops_per_token)
    assert wide.nodes[full].fwd_flops_per_token > capped.nodes[full].fwd_flops_per_token
    sdpa = trace(replace(gemma, attn_implementation="auto"), attention_len=100)
    assert sdpa.nodes[sliding].fwd_flops_per_token > wide.nodes[sliding].fwd_flops_per_token


def test_a_stage_refuses_positions_that_are_not_packed_rows(tiny_model_dir: Path, tiny_spec: ModelSpec) -> None:
    """A packed plan's stage takes `pos` with every activation and drops one that no packed row has (a position
    that neither starts a record nor follows the one before it): one line, the stage keeps serving."""
    from hetero.errors import WireError
    from hetero.runtime.wire.frames import Message
    from hetero.runtime.wire.rules import stage_rules

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN, seq_len=SEQ_LEN)
    rules = stage_rules(plan, 1)
    h = torch.zeros(TRAIN.micro_batch_size, SEQ_LEN, 64)
    good = torch.cat([torch.arange(100), torch.arange(SEQ_LEN - 100)]).repeat(TRAIN.micro_batch_size, 1)
    rules.check(Message("act", "stage0", step=0, mb=0, meta={"sent": 1.0}, tensors={"h": h, "pos": good}), [])
    skipped = good.clone()
    skipped[0, 50] = 7  # neither 0 nor 49 + 1
    with pytest.raises(WireError, match=r"tensor 'pos' is not packed rows' positions"):
        rules.check(Message("act", "stage0", step=0, mb=1, meta={"sent": 1.0}, tensors={"h": h, "pos": skipped}), [])
    with pytest.raises(WireError, match=r"carries tensors \['h'\], expected \['h', 'pos'\]"):
        rules.check(Message("act", "stage0", step=0, mb=2, meta={"sent": 1.0}, tensors={"h": h}), [])
    padded = stage_rules(make_plan(tiny_model_dir, tiny_spec.architecture, [3, 3], train=TRAIN, seq_len=SEQ_LEN,
                                   packing=False), 1)
    with pytest.raises(WireError, match=r"carries tensors \['h', 'pos'\], expected \['h'\]"):
        padded.check(Message("act", "stage0", step=0, mb=0, meta={"sent": 1.0}, tensors={"h": h, "pos": good}), [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@pytest.mark.parametrize("attention", ["sdpa", "flash_attention_2", "flex_attention"])
def test_gpu_packed_attention_equals_each_record_alone(attention: str) -> None:
    """On a GPU in bf16: a packed row's logits equal each record's alone (transformers' SDPA), with per-record
    SDPA, flash-attn's variable-length kernel (where installed) and flex attention's block mask; and the packed
    row's backward runs (flex has none on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hetero.runtime.stage.attention import flash_attn_installed

    if attention == "flash_attention_2" and not flash_attn_installed():
        pytest.skip("flash-attn is not installed")
    arch = {**COMMON, **TINY["gemma3_text"]}
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    family(config.model_type).configure(config)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    config = copy.deepcopy(config)
    family(config.model_type).configure(config, attention)
    register()
    config._attn_implementation = implementation(config._attn_implementation)
    model = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    model.load_state_dict(reference.state_dict())
    lengths = [40, 7, 25, 1]
    ids = torch.randint(3, 500, (1, sum(lengths) + 5), device="cuda")
    positions = torch.cat([torch.arange(n) for n in [*lengths, 5]]).unsqueeze(0).cuda()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    packed = model(inputs_embeds=embeds, position_ids=positions, hetero_segments=segments_of(positions)).logits
    packed.float().pow(2).mean().backward()
    at = 0
    for n in lengths:
        alone_in = embeds[:, at:at + n].detach().requires_grad_(True)
        alone = reference(inputs_embeds=alone_in).logits
        torch.testing.assert_close(packed[:, at:at + n].float(), alone.float(), rtol=2e-2, atol=2e-2)
        at += n


def test_bucketed_attention_on_cuda_leaves_out_cudnn_and_nothing_else() -> None:
    """cuDNN's SDPA plans each new shape (length buckets change shape every micro-batch: 4x slower steps on an H200,
    docs/gpu.md), so the buckets run without it; whatever else the user's flags or an outer sdpa_kernel allow stays
    allowed, and a user who allows cuDNN alone keeps it. (The flags are torch's; no GPU is needed to read them.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hetero.runtime.stage.attention import _shape_free_kernels

    def flags() -> tuple[bool, bool, bool, bool]:
        cuda = torch.backends.cuda
        return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
                cuda.cudnn_sdp_enabled())

    gpu, before = torch.device("cuda"), flags()
    with _shape_free_kernels(gpu):
        assert flags() == (True, True, True, False)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]), _shape_free_kernels(gpu):
        assert flags() == (True, False, False, False)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), _shape_free_kernels(gpu):
        assert flags() == (False, False, False, True)
    with _shape_free_kernels(torch.device("cpu")):
        assert flags() == before
    assert flags() == before
