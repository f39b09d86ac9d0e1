"""Weight streaming in the stage (plan stream_layers, runtime/stage/streaming.py).

The unit tests check one streamed Linear against the module it replaced (NF4 Linear4bit on CPU: bitsandbytes runs
there), what the streamer counts and frees, and that a cap too small is refused in one line. The pipeline tests
train 3 CPU stages with every decoder layer streaming (the planner.offload=full situation) and compare losses and
LoRA weights with the plain transformers+peft loop (tests/reference.py), and the resident peak with the plan's cap.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from hetero.errors import PlanError
from hetero.runtime.stage.lora import LoraLinear
from hetero.runtime.stage.streaming import StreamedLinear, WeightStreamer, frozen_device_bytes, stream_layer
from hetero.stream_buffer import copies_per_step

CPU = torch.device("cpu")


def _nf4_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    from hetero.runtime.stage.weights import _nf4

    return _nf4(weight.clone(), None if bias is None else nn.Parameter(bias.clone(), requires_grad=False),
                torch.float32, CPU)


def _lora_pair(base: nn.Module, streamed_base: nn.Module) -> tuple[LoraLinear, LoraLinear]:
    """The same adapter (non-zero B) on both bases."""
    torch.manual_seed(1)
    plain = LoraLinear(base, 4, 8.0, 0.0)
    streamed = LoraLinear(streamed_base, 4, 8.0, 0.0)
    with torch.no_grad():
        plain.lora_B["default"].weight.normal_()
        for part in ("lora_A", "lora_B"):
            getattr(streamed, part)["default"].weight.copy_(getattr(plain, part)["default"].weight)
    return plain, streamed


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(grad)
    return y.detach(), x.grad, module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad


def test_a_streamed_nf4_linear_equals_the_linear4bit_it_replaced() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 128, generator=gen) * 0.05, torch.randn(48, generator=gen)
    holder = nn.Module()
    holder.proj = _nf4_linear(weight, bias)
    packed, absmax = holder.proj.weight.data, holder.proj.weight.quant_state.absmax
    expected_bytes = packed.nbytes + absmax.nbytes + bias.nbytes
    streamer = WeightStreamer(0, CPU)
    assert stream_layer(holder, 0, streamer) == 1
    assert isinstance(holder.proj, StreamedLinear) and not list(holder.parameters())
    streamer.finish(0)
    plain, streamed = _lora_pair(_nf4_linear(weight, bias), holder.proj)
    x, grad = torch.randn(2, 5, 128, generator=gen), torch.randn(2, 5, 48, generator=gen)
    for name, got, want in zip(("output", "input grad", "lora_A grad", "lora_B grad"), _run(streamed, x, grad),
                               _run(plain, x, grad), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # Fetched once for forward; backward found it in the buffer: the bytes counted are one copy of the layer.
    assert streamer.stats.streamed_bytes == expected_bytes == streamer.layer_bytes(0)
    assert streamer.stats.frozen_resident_peak_bytes == expected_bytes


def _dense_stack(n: int, width: int, streamer: WeightStreamer | None) -> nn.Sequential:
    torch.manual_seed(2)
    layers = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)))
    layers.requires_grad_(False)
    if streamer is not None:
        for i, layer in enumerate(layers):
            stream_layer(layer, i, streamer)
    return layers


def test_streamed_layers_are_freed_and_only_the_buffer_stays_resident() -> None:
    n, width = 5, 32
    streamer = WeightStreamer(0, CPU)
    stack = _dense_stack(n, width, streamer)
    reference = _dense_stack(n, width, None)
    streamer.finish(frozen_device_bytes(stack))
    assert streamer.fixed_bytes == 0  # no parameter is left in the streamed layers
    layer_bytes = streamer.layer_bytes(0)
    assert layer_bytes == (width * width + width) * 4

    seen: list[weakref.ref] = []
    real_weights = streamer.weights

    def spy(layer: int, slot: int) -> list[torch.Tensor]:
        tensors = real_weights(layer, slot)
        seen.append(weakref.ref(tensors[0]))
        return tensors

    copied: list[int] = []
    real_copy = streamer._copy

    def count_copy(layer: int, nbytes: int):  # noqa: ANN202
        resident = real_copy(layer, nbytes)
        copied.append(sum(t.nbytes for slot in resident.tensors for t in slot))
        return resident

    streamer.weights = spy  # type: ignore[method-assign]
    streamer._copy = count_copy  # type: ignore[method-assign]
    x = torch.randn(3, width, requires_grad=True)
    y = stack(x)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    torch.testing.assert_close(y, reference(x_ref.detach()))
    torch.testing.assert_close(x.grad, x_ref.grad)
    # Forward 0..4 then backward 4..0: at most two layers resident at any time, the last two used now.
    assert streamer.resident_layers() == [1, 0]
    assert streamer.stats.frozen_resident_peak_bytes == 2 * layer_bytes
    alive = {ref() is not None for ref in seen[:-2]}
    assert len(seen) == 2 * n and alive == {False}, "an evicted layer's device copy is still held"
    # Forward copies each layer once (n); backward finds n-1 and n-2 resident and copies the other n-2.
    assert streamer.stats.streamed_bytes == (2 * n - 2) * layer_bytes == sum(copied)


def test_a_streamed_lora_layer_runs_fused_with_the_copies_of_the_unfused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 streamed base takes the fused LoRA kernel, as a resident nn.Linear does (the unfused path cost
    W1 ~20% a step on CPU), with the same numbers and the same copies: weights fetched in forward and again
    in backward, never saved."""
    from hetero.runtime.stage import lora as lora_module

    n, width = 4, 24
    fused: list[bool] = []
    real_apply = lora_module._LoraLinear.apply

    def spy(*args):  # noqa: ANN002, ANN202
        fused.append(args[-1] is not None if len(args) == 8 else False)
        return real_apply(*args)

    monkeypatch.setattr(lora_module._LoraLinear, "apply", spy)
    results, copies = [], []
    for streamed in (False, True):
        streamer = WeightStreamer(0, CPU)
        stack = _dense_stack(n, width, streamer if streamed else None)
        for i, layer in enumerate(stack):
            torch.manual_seed(10 + i)
            layer[0] = LoraLinear(layer[0], 4, 8.0, 0.0)
            with torch.no_grad():
                layer[0].lora_B["default"].weight.normal_()
        streamer.finish(0)
        x = torch.randn(3, width, requires_grad=True)
        y = stack(x)
        y.sum().backward()
        results.append((y.detach(), x.grad, *(layer[0].lora_A["default"].weight.grad for layer in stack)))
        copies.append(streamer.stats.streamed_bytes // max(1, streamer.layer_bytes(0)) if streamed else None)
    assert fused == [False] * n + [True] * n  # every layer fused; the streamed ones handed their StreamedLinear
    for plain, streamed in zip(*results, strict=True):
        torch.testing.assert_close(streamed, plain, rtol=0, atol=0)
    assert copies[1] == 2 * n - 2  # as the unfused path: forward n, backward finds two resident


def test_recomputed_streamed_layers_fetch_again_and_equal_the_plain_ones() -> None:
    n, width = 4, 16
    streamer = WeightStreamer(0, CPU)
    stack = _dense_stack(n, width, streamer)
    streamer.finish(0)
    reference = _dense_stack(n, width, None)
    x = torch.randn(2, width, requires_grad=True)
    h = x
    for layer in stack:
        h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
    h.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    # Each recomputed forward fetches its layer again in backward and finds it prefetched (backward travels
    # l -> l-1, recomputation included): the copies are the plain run's 2n-2.
    assert streamer.stats.streamed_bytes == (2 * n - 2) * streamer.layer_bytes(0)
    assert len(streamer.resident_layers()) <= 2


def test_a_cap_too_small_for_the_buffer_is_refused_in_one_line() -> None:
    streamer = WeightStreamer(4, CPU, cap_bytes=1000.0)
    _dense_stack(3, 16, streamer)
    with pytest.raises(PlanError) as info:
        streamer.finish(200)
    message = str(info.value)
    assert "\n" not in message and "stage 4" in message and "frozen_resident_cap_bytes" in message
    # A cap that holds the other weights and two layers is accepted, and fetching stays within it.
    fits = WeightStreamer(4, CPU, cap_bytes=200 + 2 * (16 * 16 + 16) * 4)
    stack = _dense_stack(3, 16, fits)
    fits.finish(200)
    stack(torch.randn(2, 16)).sum()
    assert fits.stats.frozen_resident_peak_bytes == fits.cap_bytes


def test_unquantized_experts_are_refused_in_one_line() -> None:
    layer = nn.Module()
    layer.experts = nn.Module()
    layer.experts.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 6), requires_grad=False)
    with pytest.raises(PlanError, match="nf4") as info:
        stream_layer(layer, 3, WeightStreamer(1, CPU))
    assert "\n" not in str(info.value) and "layers.3.experts.gate_up_proj" in str(info.value)


@pytest.mark.parametrize("layers", [[0], [0, 1]])
def test_no_plan_field_is_needed_where_nothing_streams(layers: list[int]) -> None:
    """A Linear outside the streamed layers keeps its parameter (and the fused LoRA path)."""
    stack = _dense_stack(2, 8, None)
    streamer = WeightStreamer(0, CPU)
    for i in layers:
        stream_layer(stack[i], i, streamer)
    kept = [name for name, _ in stack.named_parameters()]
    assert kept == [f"{i}.0.{p}" for i in range(2) if i not in layers for p in ("weight", "bias")]



# -- the pipeline: 3 CPU stage processes, every decoder layer streaming ------------------------------------------

SEQ_LEN = 32
RTOL = 1e-4
LAYER_BYTES = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 172 * 64 * 3)  # a tiny decoder layer's projections in fp32


def _frozen_bytes(model_dir: Path) -> dict[str, int]:
    """Each stored tensor's bytes in the plans' float32."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for key in h.keys():
                sizes[key] = 4 * int(torch.Size(h.get_slice(key).get_shape()).numel())
    return sizes


def streaming_plan(plan, model_dir: Path):  # noqa: ANN001, ANN201 (hetero.plan.Plan)
    """``plan`` with every decoder layer streaming, and per stage the cap a planner would set: its frozen
    tensors outside the streamed Linears + its two largest streamed layers' Linear weights."""
    from hetero.plan import compute_input_hash

    sizes, stages = _frozen_bytes(model_dir), []
    for sp in plan.stages:
        nodes = plan.graph.nodes[sp.first_node:sp.last_node + 1]
        layer_bytes = {nd.name: sum(sizes[n] for n in nd.param_names if n.endswith("_proj.weight"))
                       for nd in nodes if nd.kind == "decoder"}
        fixed = sum(sizes[n] for nd in nodes for n in nd.param_names) - sum(layer_bytes.values())
        cap = fixed + sum(sorted(layer_bytes.values(), reverse=True)[:2])
        per_step = 2 * plan.train.num_micro_batches * sum(layer_bytes.values())  # every F and every B fetches
        stages.append(replace(sp, stream_layers=list(layer_bytes), frozen_resident_cap_bytes=float(cap),
                              streamed_bytes_per_step=float(per_step)))
    streaming = replace(plan, stages=stages)
    return replace(streaming, input_hash=compute_input_hash(streaming))


@pytest.fixture(scope="module")
def reference(references: Callable[..., dict], tiny_model_dir: Path) -> dict:
    from plans import TRAIN

    return references(tiny_model_dir, TRAIN, SEQ_LEN)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_pipeline_streaming_every_layer_equals_the_reference(recompute: str, reference: dict, tiny_model_dir: Path,
                                                               tiny_spec) -> None:  # noqa: ANN001
    from metrics_rows import read_metrics, step_lines
    from plans import TRAIN, make_plan
    from reference import assert_close_to_scale

    from hetero.runtime.cli import main_run
    from hetero.runtime.stage.adapter import load_adapter_state

    # Stage 0 streams 3 layers, more than its buffer of two: layers really come and go every step.
    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 2, 1], train=replace(TRAIN, schedule="1f1b"),
                     lora=reference["lora"], seq_len=SEQ_LEN, recompute=recompute)
    plan = streaming_plan(plan, tiny_model_dir)
    run_dir = reference["root"] / f"run-{recompute}"
    plan.save(reference["root"] / f"plan-{recompute}.json")
    assert main_run([str(reference["root"] / f"plan-{recompute}.json"), "--run-dir", str(run_dir),
                     "--no-progress"]) == 0

    metrics = step_lines(read_metrics(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, TRAIN.steps + 1))
    for m, want in zip(metrics, reference["losses"], strict=True):
        assert m["loss"] == pytest.approx(want, rel=RTOL), f"step {m['step']}: loss {m['loss']} vs reference {want}"
    trained = load_adapter_state(run_dir / "adapter", reference["lora"])
    assert set(trained) == set(reference["state"])
    for key, want in reference["state"].items():
        assert_close_to_scale(key, trained[key], want, RTOL)

    caps = [sp.frozen_resident_cap_bytes for sp in plan.stages]
    for m in metrics:
        peaks, streamed = m["stage_frozen_resident_peak_bytes"], m["stage_streamed_bytes"]
        assert all(p <= cap for p, cap in zip(peaks, caps, strict=True)), (peaks, caps)
        # Its buffer full (two streamed layers, stage 2's one): each stage holds exactly its cap at its peak.
        assert peaks == caps
        assert streamed[0] > 0, "stage 0's three layers cannot all stay in a buffer of two"
    # Every step after the first copies what the buffer policy counts for the stage's program (each layer of
    # this model has the same bytes): 1F1B's back-to-back forwards evict, a stage of two layers never does.
    for k, sp in enumerate(plan.stages):
        layers = sorted(int(name.rsplit(".", 1)[1]) for name in sp.stream_layers)
        copies = sum(copies_per_step([a.op for a in sp.actions()], layers).values())
        assert {m["stage_streamed_bytes"][k] for m in metrics[1:]} == {copies * LAYER_BYTES}, k
    assert metrics[1]["stage_streamed_bytes"][0] > 0 and metrics[1]["stage_streamed_bytes"][1:] == [0, 0]
    report = json.loads((run_dir / "report.json").read_text())
    assert [s["within_cap"] for s in report["streaming"]] == [True] * 3
    assert report["streaming"][0]["measured_streamed_bytes_per_step"] > 0


def test_stepdone_carries_streaming_and_old_frames_still_parse(tiny_model_dir: Path, tiny_spec) -> None:  # noqa: ANN001
    from plans import make_plan

    from hetero.protocol import StepDone
    from hetero.runtime.run.metrics_file import to_json
    from hetero.runtime.run.records import metrics_line
    from hetero.runtime.stage.executor import StepStats

    stats = StepStats(step=1, loss_sum=3.0, num_label_tokens=4, grad_sumsq=0.5, lr=1e-3, busy_s=0.1, wall_s=0.2,
                      op_time_s={"F": 0.05}, streamed_bytes=4096, frozen_resident_peak_bytes=8192)
    meta = stats.to_meta()
    got = StepDone.from_wire(meta)
    assert (got.streamed_bytes, got.frozen_resident_peak_bytes, got.extra) == (4096, 8192, {})
    old = {k: v for k, v in meta.items() if k not in ("streamed_bytes", "frozen_resident_peak_bytes")}
    assert StepDone.from_wire(old).streamed_bytes is None
    assert "streamed_bytes" not in replace(stats, streamed_bytes=None).to_meta()

    plain = make_plan(tiny_model_dir, tiny_spec.architecture, [2, 2, 2])
    done = {k: type("Msg", (), {"meta": {**meta, "loss_sum": 3.0}})() for k in range(3)}
    line = json.loads(to_json(metrics_line(plain, 1, done, 0.7, 1.0, 4, 0.2)))  # as metrics.jsonl holds it
    assert "stage_streamed_bytes" not in line, "a plan without streaming keeps its metrics lines"
    streaming = streaming_plan(plain, tiny_model_dir)
    line = json.loads(to_json(metrics_line(streaming, 1, done, 0.7, 1.0, 4, 0.2)))
    assert line["stage_streamed_bytes"] == [4096] * 3 and line["stage_frozen_resident_peak_bytes"] == [8192] * 3
    # Which layers stream, and the cap, were planned for each stage's own span: such a plan keeps its split.
    from hetero.runtime.wire.rules import can_rebalance

    assert can_rebalance(plain) and not can_rebalance(streaming)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_streaming_nf4_stage_equals_the_resident_one(tiny_model_dir: Path, tiny_spec, recompute: str) -> None:  # noqa: ANN001
    """Stage 1 of an NF4 plan (two layers, hidden states in), built resident and streaming: same output, input and
    LoRA gradients; the streamed one holds no NF4 Linear of its layers on the device."""
    from plans import make_plan

    from hetero.runtime.stage.model import build_stage

    plan = make_plan(tiny_model_dir, tiny_spec.architecture, [3, 2, 1], quantization="nf4", seq_len=24,
                     recompute=recompute)
    plain, streamed = build_stage(plan, 1, CPU), build_stage(streaming_plan(plan, tiny_model_dir), 1, CPU)
    assert streamed.streamer is not None and sorted(streamed.streamer.layers) == [3, 4]
    assert not any(_is_nf4(m) for m in streamed.model.model.layers.modules())
    assert frozen_device_bytes(streamed.model) < frozen_device_bytes(plain.model)
    gen = torch.Generator().manual_seed(5)
    state = {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in plain.lora_state().items()}
    outs = []
    for stage in (plain, streamed):
        stage.load_lora_state(state)
        x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(6)).requires_grad_(True)
        y = stage.forward(x)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), x.grad, [p.grad for p in stage.lora_parameters()]))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert streamed.streamer.stats.streamed_bytes == sum(streamed.streamer.layer_bytes(i) for i in (3, 4))


def _is_nf4(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear4bit"


def test_streamed_nf4_experts_equal_the_resident_ones() -> None:
    """A NF4 mixture of experts (runtime/stage/experts.py) streams through its Linear4bit experts."""
    from hetero.runtime.stage.experts import NF4Experts

    gen = torch.Generator().manual_seed(3)
    gate_up = [torch.randn(64, 64, generator=gen) * 0.05 for _ in range(3)]
    down = [torch.randn(64, 32, generator=gen) * 0.05 for _ in range(3)]

    def experts() -> NF4Experts:
        return NF4Experts([_nf4_linear(w, None) for w in gate_up], [_nf4_linear(w, None) for w in down],
                          torch.nn.functional.silu)

    plain, layer = experts(), nn.Module()
    layer.experts = experts()
    streamer = WeightStreamer(0, CPU)
    assert stream_layer(layer, 0, streamer) == 6
    streamer.finish(0)
    x = torch.randn(10, 64, generator=gen)
    index = torch.randint(0, 3, (10, 2), generator=gen)
    weights = torch.rand(10, 2, generator=gen)
    grads = []
    for module in (plain, layer.experts):
        xi = x.clone().requires_grad_(True)
        y = module(xi, index, weights)
        y.sum().backward()
        grads.append((y.detach(), xi.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_cuda_streaming_copies_from_pinned_memory_on_a_side_stream() -> None:
    cuda = torch.device("cuda", 0)
    n, width = 6, 1024
    streamer = WeightStreamer(0, cuda)
    stack = _dense_stack(n, width, streamer).to(cuda)
    reference = _dense_stack(n, width, None).to(cuda)
    streamer.finish(frozen_device_bytes(stack))
    assert all(t.is_pinned() for hosts in streamer.layers.values() for h in hosts for t in h.tensors)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(cuda)
    x = torch.randn(64, width, device=cuda, requires_grad=True)
    y = stack(x)
    y.sum().backward()
    torch.cuda.synchronize()
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = reference(x_ref)
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert streamer.resident_layers() == [1, 0]
    # What stays allocated after the step: the two buffered layers (4 MB each) and a few activation-sized
    # tensors (x, y, their reference twins and gradients: 256 KB each), not six layers.
    layer = streamer.layer_bytes(0)
    assert torch.cuda.memory_allocated(cuda) - before <= 2 * layer + (4 << 20)


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_the_planners_cap_is_what_the_stage_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   tiny_model_dir: Path, quantization: str) -> None:
    """A compiled planner.offload=full plan: every stage builds, and its frozen bytes outside the streamed Linears
    plus its two-layer buffer are exactly the plan's frozen_resident_cap_bytes (one accounting on both sides)."""
    from cli_calls import compile_plan

    from hetero.runtime.stage.model import build_stage

    code, _, err, plan = compile_plan(tmp_path, capsys, "model=tiny", "hardware=local", "hardware.num_devices=3",
                                      "+hardware.hosts.0.ram_gb=16", "planner.offload=full", "planner.split=[3,2,1]",
                                      f"model.quantization={quantization}")
    assert code == 0 and plan is not None, err
    for k, sp in enumerate(plan.stages):
        # Every decoder layer, as streaming_plan sets them for the equivalence test above: that test's plan is this one's.
        assert sp.stream_layers == [n for n in sp.node_names if n.startswith("layers.")], k
        streamer = build_stage(plan, k, CPU).streamer
        assert streamer is not None
        buffer = sorted((streamer.layer_bytes(i) for i in streamer.layers), reverse=True)[:2]
        assert streamer.fixed_bytes + sum(buffer) == sp.frozen_resident_cap_bytes, k
        # The plan's bytes per step are the stage's own layer bytes times the copies its program makes.
        copies = copies_per_step([a.op for a in sp.actions()], list(streamer.layers))
        assert sum(streamer.layer_bytes(i) * c for i, c in copies.items()) == sp.streamed_bytes_per_step, k


def test_the_buffer_policy_counts_copies_per_step() -> None:
    # Two streamed layers fit the buffer: after the first step nothing is copied again.
    assert copies_per_step(["RA", "F", "SA", "RG", "B", "SG", "STEP"], [3, 4]) == {3: 0, 4: 0}
    # Forward then backward of one micro-batch at a time: the two layers at the turn stay, the others move twice.
    assert sum(copies_per_step(["F", "B"] * 4, range(5)).values()) == 4 * (2 * 5 - 4)
    # Back-to-back forwards (GPipe, 1F1B's warm-up) start each from layer 0 again: more copies.
    assert sum(copies_per_step(["F"] * 4 + ["B"] * 4, range(5)).values()) > 4 * (2 * 5 - 4)
