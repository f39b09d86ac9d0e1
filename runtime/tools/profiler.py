"""Measure one device for `hetero profile`: one real layer of each kind, timed at several token counts.

The probe is the model's own CausalLM pruned to embedding + ONE decoder layer + norm + head (built
with the runtime's helpers, random weights: no download), at the device's dtype, quantized like the
runtime quantizes it, with the model's LoRA. Each layer kind is timed forward and backward the way
the executor runs it (received activations require grad; the head includes the fp32 loss) at
several micro-batch sizes, and ``time = a + b * tokens`` is fitted by least squares.

Memory: the bytes a forward leaves alive for its backward are counted exactly on every device
with ``hetero.runtime.stage.memory.kept_bytes`` (storages the forward created that are still alive:
saved tensors, bitsandbytes' context tensors, a recomputing layer's input), for the decoder layer
both as it runs and recomputing (non-reentrant checkpoint, as the runtime's Stage does). On CUDA
the peak is ``torch.cuda.max_memory_allocated`` above the pre-call level; on CPU there is no
allocator peak to read, so the peak per token is the kept bytes per token (method says which).

Besides the layers, the two costs a stage pays outside its layers' compute: the optimizer step
(the executor's own code: gradient norm, AdamW, schedule, zero_grad) against the number of LoRA
parameters, and the CPU time of sending and of receiving one activation message over the
runtime's transport against its bytes. For weight streaming (planner.offload), the rate at which
the decoder layer's frozen weights reach the device through the runtime's own WeightStreamer, and
the host's available RAM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from hetero.errors import HeteroError
from hetero.families import family, layer_types
from hetero.profile import DeviceProfile, LayerProfile, LinearFit, fit_line, typical
from hetero.runtime.stage.lora import share_lora_inputs
from hetero.runtime.stage.loss import chunked_loss_sum
from hetero.runtime.stage.memory import kept_bytes
from hetero.runtime.stage.model import StageLayout, _build_config, _skeleton, attention_masks, rotary_tables
from hetero.runtime.stage.weights import quantize_nf4
from hetero.runtime.tools.device_facts import available_ram_gb, telemetry, usable_memory_gb
from hetero.runtime.wire.frames import TORCH_DTYPES
from hetero.specs import DeviceSpec, ModelSpec, TrainSpec

OPTIMIZER_COPIES = (1, 2, 4, 8)  # optimizer steps over this many decoder layers' LoRA parameters
MIN_REPEATS = 3
MAX_REPEATS = 40
TARGET_S = 0.3  # per (kind, token count): repeat until this much time is measured
DECODER_WINDOW_S = 3.0  # the decoder layer's sizes together: long enough to average a drifting machine


class ProfileFailedError(HeteroError):
    """The device could not run the probe layer at all (out of memory at the smallest size, no device)."""


@dataclass
class Probe:
    """The pruned CausalLM (embedding, one decoder layer, norm, head) with LoRA, on its device."""

    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    hidden: int
    vocab: int
    lora_params_per_layer: int


def build_probe(model: ModelSpec, device: torch.device, dtype: str, quantization: str, seed: int = 0) -> Probe:
    """Build one layer of each kind of ``model`` on ``device`` (random weights, LoRA like the runtime)."""
    from peft import LoraConfig, get_peft_model

    torch_dtype = TORCH_DTYPES[dtype]
    config = _build_config(model.architecture, model.attn_implementation, device, torch_dtype,
                           model.experts_implementation)
    m = _skeleton(config, StageLayout(embed=True, layers=[0], norm=True, head=True))
    m.to_empty(device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # the initializer_range of HF Llama-family configs; values only matter for NaNs
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    # to_empty left the rotary buffers uninitialised: rebuild them as the stage does.
    m.model.rotary_emb = type(m.model.rotary_emb)(config=config).to(device)
    m.to(torch_dtype)
    m.requires_grad_(False)
    if quantization == "nf4":
        quantize_nf4(m, torch_dtype, device, family(config.model_type).experts)
    m.eval()
    lora = model.lora
    peft = get_peft_model(m, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                        target_modules=list(lora.target_modules), bias="none",
                                        task_type="CAUSAL_LM"))
    peft.to(device)
    peft.train()
    share_lora_inputs(peft)  # the runtime's LoRA path (runtime/stage/lora.py), so memory is the runtime's
    n_lora = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    return Probe(m, device, torch_dtype, int(config.hidden_size), int(config.vocab_size), n_lora)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layer_call(probe: Probe, kind: str, batch: int, seq: int, recompute: bool = False
                ) -> Callable[[], tuple[Any, Any]]:
    """A closure that runs the forward of one layer kind and returns (output to backprop, its grad);
    ``recompute``: the decoder layer recomputes in backward, as Stage.forward runs it."""
    inner = probe.model.model
    dev, dt = probe.device, probe.dtype
    layer = next(iter(inner.layers.values()))
    ids = torch.randint(0, probe.vocab, (batch, seq), device=dev)

    def hidden() -> torch.Tensor:
        return torch.randn(batch, seq, probe.hidden, device=dev, dtype=dt).requires_grad_(True)

    if kind == "embedding":
        return lambda: (inner.embed_tokens(ids), None)
    if kind == "decoder":
        def decoder() -> tuple[Any, Any]:
            h = hidden()
            # Positions and rotary tables are rebuilt per stage forward in the runtime: charged here.
            pos = torch.arange(seq, device=dev).unsqueeze(0)
            # ... and so are the masks of layers that take one: the probe's layer is the model's first (its kind).
            kind = layer_types(probe.model.config)[0]
            per_kind = family(probe.model.config.model_type).rotary_per_layer_type
            emb = rotary_tables(probe.model, h, pos, {kind}, per_kind)
            kwargs = {"attention_mask": attention_masks(probe.model, h, pos, {kind}).get(kind), "position_ids": pos,
                      "position_embeddings": emb[kind]}
            if recompute:
                out = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False, **kwargs)
            else:
                out = layer(h, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            return out, torch.ones_like(out)
        return decoder
    if kind == "norm":
        def norm() -> tuple[Any, Any]:
            out = inner.norm(hidden())
            return out, torch.ones_like(out)
        return norm
    if kind == "head":
        def head() -> tuple[Any, Any]:
            # As the last stage computes it (runtime/stage/loss.py): in chunks, a frozen head's input gradient in
            # forward, so forward and backward split the head's work as a run does.
            frozen = not any(p.requires_grad for p in probe.model.lm_head.parameters())
            loss = chunked_loss_sum(probe.model.lm_head, hidden(), ids, int(probe.model.config.vocab_size), frozen)
            return loss / ids.numel(), None
        return head
    raise ValueError(f"unknown layer kind {kind!r}")


def _time_once(call: Callable[[], tuple[Any, Any]], device: torch.device) -> tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    out, grad = call()
    _sync(device)
    t1 = time.perf_counter()
    if out.requires_grad:
        out.backward(grad)
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def _kept_bytes(call: Callable[[], tuple[Any, Any]]) -> int:
    """Bytes the forward leaves alive for backward (see hetero.runtime.stage.memory)."""
    return kept_bytes(call)


def _peak_bytes(call: Callable[[], tuple[Any, Any]], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out, grad = call()
    if out.requires_grad:
        out.backward(grad)
    _sync(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def _zero_grads(probe: Probe) -> None:
    for p in probe.model.parameters():
        p.grad = None


def profile_layer(probe: Probe, kind: str, batches: list[int], seq: int) -> tuple[LayerProfile, list[int]]:
    """Time and size one layer kind at each micro-batch size; returns the profile and token counts used.

    The sizes are timed round-robin, not one after the other: a machine whose speed drifts (shared
    hosts, boost clocks, thermal limits) then slows every size alike instead of bending the fit.
    The decoder layer, which dominates every stage, is timed over a longer window (DECODER_WINDOW_S).
    """
    calls: list[tuple[int, Callable[[], tuple[Any, Any]]]] = []
    saved: list[int] = []
    recomputed: list[int] = []
    peaks: list[int] = []
    for batch in batches:  # build, warm up and size each; stop at the first size that does not fit
        call = _layer_call(probe, kind, batch, seq)
        try:
            _time_once(call, probe.device)  # warm-up: kernels, allocator, lazy init
            size_saved = _kept_bytes(call)
            size_recomputed = _kept_bytes(_layer_call(probe, kind, batch, seq, True)) if kind == "decoder" else 0
            peak = _peak_bytes(call, probe.device)
        except torch.OutOfMemoryError:
            if not calls:
                raise ProfileFailedError(f"{probe.device}: out of memory profiling one {kind} layer at "
                                         f"{batch * seq} tokens; the model does not fit this device") from None
            break  # larger sizes will not fit either: fit what we have
        finally:
            _zero_grads(probe)
        calls.append((batch * seq, call))
        saved.append(size_saved)
        recomputed.append(size_recomputed)
        if peak is not None:
            peaks.append(peak)
    window, cap = (DECODER_WINDOW_S, 4 * MAX_REPEATS) if kind == "decoder" else (TARGET_S * len(calls), MAX_REPEATS)
    samples: list[list[tuple[float, float]]] = [[] for _ in calls]
    spent, t_start = 0.0, time.perf_counter()
    while len(samples[0]) < cap and (len(samples[0]) < MIN_REPEATS or spent < window):
        for (_, call), into in zip(calls, samples, strict=True):
            into.append(_time_once(call, probe.device))
            _zero_grads(probe)
        spent = time.perf_counter() - t_start
    tokens = [t for t, _ in calls]
    fwd = [typical([s[0] for s in size]) for size in samples]
    bwd = [typical([s[1] for s in size]) for size in samples]
    saved_fit = fit_line(tokens, saved) if len(tokens) > 1 else None
    per_token = max(0.0, saved_fit.b_s_per_token) if saved_fit else saved[0] / max(tokens[0], 1)
    recompute_per_token: float | None = None
    if kind == "decoder":
        rec_fit = fit_line(tokens, recomputed) if len(tokens) > 1 else None
        recompute_per_token = max(0.0, rec_fit.b_s_per_token) if rec_fit else recomputed[0] / max(tokens[0], 1)
    if peaks:
        peak_fit = fit_line(tokens, peaks) if len(tokens) > 1 else None
        peak_per_token = max(0.0, peak_fit.b_s_per_token) if peak_fit else peaks[0] / tokens[0]
        method = "kept storages; peak: cuda max_memory_allocated"
    else:
        peak_per_token = per_token
        method = "kept storages; peak: not measurable on CPU, taken as the kept bytes"
    sub = {"embedding": probe.model.model.embed_tokens, "norm": probe.model.model.norm,
           "head": probe.model.lm_head}.get(kind) or next(iter(probe.model.model.layers.values()))
    weight_bytes = float(sum(t.numel() * t.element_size() for t in [*sub.parameters(), *sub.buffers()]))
    lora = sum(p.numel() for p in sub.parameters() if p.requires_grad)
    return LayerProfile(kind, fit_line(tokens, fwd), fit_line(tokens, bwd), weight_bytes, lora,
                        per_token, peak_per_token, method, recompute_per_token), tokens


def _typical_time(run: Callable[[], None], prepare: Callable[[], None], device: torch.device) -> float:
    """Typical seconds of ``run`` (``prepare`` before each, untimed) after one warm-up call."""
    samples: list[float] = []
    spent, t_start = 0.0, time.perf_counter()
    for i in range(MAX_REPEATS + 1):
        if i > MIN_REPEATS and spent >= TARGET_S:
            break
        prepare()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        if i > 0:  # the first call warms up
            samples.append(time.perf_counter() - t0)
        spent = time.perf_counter() - t_start
    return typical(samples)


def profile_optimizer(probe: Probe) -> LinearFit | None:
    """Seconds of one optimizer step against LoRA parameters (x = parameters, slope per parameter).

    Runs the executor's own step (grad norm, AdamW, LR schedule, zero_grad) over copies of one
    decoder layer's LoRA tensors, so the per-tensor cost (the loop over tensors) and the
    per-element cost are both in the fit. None when the model has no LoRA in its decoder layers.
    """
    from hetero.runtime.stage.executor import apply_step, build_optimizer, grad_sumsq

    layer = next(iter(probe.model.model.layers.values()))
    like = [p for p in layer.parameters() if p.requires_grad]
    if not like:
        return None
    xs: list[float] = []
    ys: list[float] = []
    for copies in OPTIMIZER_COPIES:
        params = [nn.Parameter(torch.zeros_like(p)) for _ in range(copies) for p in like]
        optimizer, scheduler = build_optimizer(params, TrainSpec(steps=10 * MAX_REPEATS))

        def grads(params: list[nn.Parameter] = params) -> None:
            for p in params:
                p.grad = torch.full_like(p, 1e-3)

        def step(params: list[nn.Parameter] = params, optimizer: Any = optimizer, scheduler: Any = scheduler) -> None:
            grad_sumsq(params)
            apply_step(params, optimizer, scheduler, 1.0)

        xs.append(float(sum(p.numel() for p in params)))
        ys.append(_typical_time(step, grads, probe.device))
    return fit_line(xs, ys)


def profile_codec(probe: Probe, token_counts: list[int]) -> tuple[dict[str, LinearFit], dict[str, LinearFit]]:
    """Per compression scheme, the seconds to encode and to decode one hand-off (runtime/wire/compress.py, what a
    stage runs on a compressed link) against its values (x = values), at the device's compute dtype."""
    from hetero.runtime.wire import compress

    encode: dict[str, LinearFit] = {}
    decode: dict[str, LinearFit] = {}
    for scheme in (s for s in compress.SCHEMES if s != "none"):
        values, enc_s, dec_s = [], [], []
        for tokens in token_counts:
            h = torch.randn(tokens, probe.hidden, device=probe.device, dtype=probe.dtype)
            parts = compress.encode(h, scheme)
            values.append(float(h.numel()))
            enc_s.append(_typical_time(lambda h=h, scheme=scheme: compress.encode(h, scheme), lambda: None, probe.device))
            dec_s.append(_typical_time(lambda p=parts, scheme=scheme: compress.decode(p, scheme, probe.hidden, probe.dtype),
                                       lambda: None, probe.device))
        encode[scheme], decode[scheme] = fit_line(values, enc_s), fit_line(values, dec_s)
    return encode, decode


def profile_messages(probe: Probe, token_counts: list[int]) -> tuple[LinearFit, LinearFit]:
    """CPU seconds to send, and to receive, one activation message against its bytes (x = bytes).

    Sends go through a runtime Transport to a second one in this process (loopback): the send is
    timed in the caller (encode, a GPU tensor's copy to the host, handing the frames to ZeroMQ); the
    receive is timed once the message has arrived (decode and the copy onto the device), the way
    the executor receives (through the Mailbox, which also looks at control messages).
    """
    from hetero.runtime.wire.control import Mailbox
    from hetero.runtime.wire.transport import Transport

    sizes, send_s, recv_s = [], [], []
    with Transport("probe-rx", "tcp://127.0.0.1:0", "probe", recv_timeout_s=30.0) as rx, \
            Transport("probe-tx", None, "probe") as tx:
        assert rx.endpoint is not None
        tx.connect("probe-rx", rx.endpoint)
        inbox = Mailbox(rx)
        for tokens in token_counts:
            h = torch.randn(tokens, probe.hidden, device=probe.device, dtype=probe.dtype)
            num_bytes = h.numel() * h.element_size()
            settle = 0.002 + 4.0 * num_bytes / 1e9  # loopback moves > 1 GB/s: the message is in by then
            sends, recvs = [], []
            for i in range(MIN_REPEATS + 3):
                _sync(probe.device)
                t0 = time.perf_counter()
                tx.send("probe-rx", "act", step=0, mb=i, tensors={"h": h})
                t1 = time.perf_counter()
                time.sleep(settle)
                t2 = time.perf_counter()
                msg = inbox.recv("act", step=0, mb=i, timeout_s=30.0)
                x = msg.tensors["h"].to(probe.device, probe.dtype).requires_grad_(True)
                _sync(probe.device)
                t3 = time.perf_counter()
                del x, msg
                if i > 0:
                    sends.append(t1 - t0)
                    recvs.append(t3 - t2)
            sizes.append(float(num_bytes))
            send_s.append(typical(sends))
            recv_s.append(typical(recvs))
    return fit_line(sizes, send_s), fit_line(sizes, recv_s)


def profile_host_link(probe: Probe) -> float | None:
    """GB/s at which the probe's decoder layer's frozen weights reach the device, copied as a streamed layer's are
    (runtime/stage/streaming.py: from pinned memory on a CUDA side stream, waited for; on CPU into fresh
    tensors). None when the layer has no frozen Linear to stream."""
    from hetero.runtime.stage.streaming import WeightStreamer, host_linear

    layer = next(iter(probe.model.model.layers.values()))
    streamer = WeightStreamer(stage=0, device=probe.device)
    for name, module in layer.named_modules():
        if "lora_" in name or any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        host = host_linear(module, streamer)
        if host is not None:
            streamer.add(0, host)
    if not streamer.layers:
        return None
    seconds = _typical_time(lambda: streamer.copy_layer(0), lambda: None, probe.device)
    return streamer.layer_bytes(0) / max(seconds, 1e-9) / 1e9


def decoder_load(model: ModelSpec, device_spec: DeviceSpec, torch_device: torch.device,
                 micro_batch_size: int) -> Callable[[], None]:
    """One forward+backward of a decoder layer at the planned micro-batch: the work a stage repeats in a run.

    A host's other CPU stages run it in a loop while one of them is measured, so that stage is timed
    sharing the cores the way 1F1B's steady state makes it share them.
    """
    probe = build_probe(model, torch_device, device_spec.compute_dtype(model.dtype),
                        device_spec.quantization(model.quantization))
    call = _layer_call(probe, "decoder", micro_batch_size, model.seq_len)

    def step() -> None:
        _time_once(call, probe.device)
        _zero_grads(probe)

    return step


def batch_sizes(micro_batch_size: int) -> list[int]:
    """Micro-batch sizes to time: around the planned one, so the fit is tight where it is used."""
    return sorted({1, max(1, micro_batch_size // 2), micro_batch_size, 2 * micro_batch_size})


def profile_device(model: ModelSpec, device_spec: DeviceSpec, torch_device: torch.device, *,
                   micro_batch_size: int = 1, share: int = 1,
                   on_layer: Callable[[str], None] | None = None,
                   measured_with: list[str] | None = None) -> DeviceProfile:
    """Measure every layer kind of ``model`` on one device (call with that device's threads set)."""
    started, t0 = time.time(), time.perf_counter()
    dtype = device_spec.compute_dtype(model.dtype)
    quant = device_spec.quantization(model.quantization)
    probe = build_probe(model, torch_device, dtype, quant)
    layers: dict[str, LayerProfile] = {}
    tokens: list[int] = []
    for kind in ("embedding", "decoder", "norm", "head"):
        layers[kind], used = profile_layer(probe, kind, batch_sizes(micro_batch_size), model.seq_len)
        tokens = sorted(set(tokens) | set(used))
        if on_layer is not None:
            on_layer(kind)
    optimizer = profile_optimizer(probe)
    if on_layer is not None:
        on_layer("optimizer")
    send, recv = profile_messages(probe, tokens)
    if on_layer is not None:
        on_layer("messages")
    codec_encode, codec_decode = profile_codec(probe, tokens)
    if on_layer is not None:
        on_layer("codec")
    host_link = profile_host_link(probe)
    if on_layer is not None:
        on_layer("host link")
    from hetero.runtime.base.env import describe_environment

    return DeviceProfile(
        device=device_spec.name, host=device_spec.host, type=device_spec.type, backend=device_spec.backend,
        dtype=dtype, quantization=quant, threads=device_spec.threads,
        usable_memory_gb=usable_memory_gb(torch_device, share), seq_len=model.seq_len, token_counts=tokens,
        layers=layers, optimizer=optimizer, message_send=send, message_recv=recv, telemetry=telemetry(torch_device),
        environment={**describe_environment(str(torch_device)), "torch_threads": torch.get_num_threads()},
        seconds=time.perf_counter() - t0, started_unix_s=started, measured_with=list(measured_with or []),
        host_link_gbs=host_link, host_ram_gb=available_ram_gb(), codec_encode=codec_encode, codec_decode=codec_decode,
    )
