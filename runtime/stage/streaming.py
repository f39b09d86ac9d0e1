"""Weight streaming (plan ``stream_layers``, issue 26): a decoder layer's frozen Linear weights live in host RAM
and are copied to the device just before each use.

``stream_layer`` replaces every frozen Linear of a layer -- plain ``nn.Linear`` or bitsandbytes NF4
``Linear4bit``, those of ``NF4Experts`` included -- by a ``StreamedLinear`` that registers no parameter: its
weights (NF4: the packed bytes and the quantization state's absmax and code) are kept by the stage's
``WeightStreamer``, pinned on CUDA so the copies can overlap compute. ``_StreamedMatmul`` fetches them in forward
and again in backward for the input gradient, and saves nothing for backward (the base weights are frozen: their
gradient, the only use of the input, is never formed). LoRA wraps a ``StreamedLinear`` as it wraps a Linear
(runtime/stage/lora.py): the adapter's delta runs beside it, in peft's order. A recomputed layer's forward runs
again in backward and asks for its weights again (it finds them in the buffer).

The streamer keeps at most ``BUFFER_LAYERS`` layers resident: the one in use and the next in the direction of
travel (forward l -> l+1, backward -- recomputation included -- l -> l-1), prefetched; hetero/stream_buffer.py is
that policy, and counts a program's copies for the planner. On CUDA the copy runs on a
side stream from pinned memory and the compute stream waits on its event; elsewhere it is a synchronous copy into
a fresh tensor (one code path; what is resident really is). Per step it counts the bytes copied and the peak of
frozen-weight bytes on the device (every other frozen tensor of the stage + the buffer), and refuses to exceed
the plan's ``frozen_resident_cap_bytes``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetero.errors import PlanError
from hetero.stream_buffer import BUFFER_LAYERS, LayerBuffer

MB = 1 << 20


@dataclass
class HostLinear:
    """One streamed Linear's frozen tensors in host memory: [weight, bias?] or NF4 [packed, absmax, bias?]."""

    tensors: list[torch.Tensor]
    has_bias: bool
    nf4: dict[str, Any] | None = None  # the quantization state's scalars (shape, blocksize, quant_type, dtype)
    compute_dtype: torch.dtype | None = None  # NF4: what Linear4bit computes in


@dataclass
class _Resident:
    """A layer's device copies (per Linear of the layer), and on CUDA the event that says the copy is done."""

    tensors: list[list[torch.Tensor]]
    nbytes: int
    event: Any = None


@dataclass
class StreamStats:
    """One step's streaming: bytes copied host-to-device and the most frozen-weight bytes on the device at once."""

    streamed_bytes: int = 0
    frozen_resident_peak_bytes: int = 0


@dataclass
class WeightStreamer:
    """A stage's streamed layers' host weights, its device buffer of at most BUFFER_LAYERS layers, and its counts."""

    stage: int
    device: torch.device
    cap_bytes: float = 0.0  # the plan's frozen_resident_cap_bytes (0: the plan sets none)
    fixed_bytes: int = 0  # frozen bytes on the device outside the buffer (set once the stage is built)
    layers: dict[int, list[HostLinear]] = field(default_factory=dict)
    stats: StreamStats = field(default_factory=StreamStats)
    _buffer: dict[int, _Resident] = field(default_factory=dict)
    _policy: LayerBuffer = field(default_factory=lambda: LayerBuffer([]))
    _side: Any = None  # CUDA side stream for the copies

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._side = torch.cuda.Stream(self.device)

    @property
    def pinned(self) -> bool:
        return self.device.type == "cuda"

    def add(self, layer: int, host: HostLinear) -> int:
        """Keep ``host`` as the next Linear of ``layer``; returns its slot in the layer."""
        self.layers.setdefault(layer, []).append(host)
        return len(self.layers[layer]) - 1

    def layer_bytes(self, layer: int) -> int:
        return sum(t.nbytes for h in self.layers[layer] for t in h.tensors)

    def resident_layers(self) -> list[int]:
        """The layers whose weights are on the device now (the buffer), least recently used first."""
        return list(self._policy.resident)

    def resident_bytes(self) -> int:
        """Frozen-weight bytes on the device now: the stage's other frozen tensors and the buffer."""
        return self.fixed_bytes + sum(r.nbytes for r in self._buffer.values())

    def finish(self, fixed_bytes: int) -> None:
        """The stage is built: note its other frozen bytes and refuse a plan whose cap cannot hold the buffer."""
        self.fixed_bytes = fixed_bytes
        self._policy = LayerBuffer(list(self.layers))
        largest = sorted((self.layer_bytes(i) for i in self.layers), reverse=True)[:BUFFER_LAYERS]
        need = fixed_bytes + sum(largest)
        if self.cap_bytes > 0 and need > self.cap_bytes:
            raise PlanError(f"stage {self.stage}: its frozen weights outside streamed layers ({fixed_bytes / MB:.2f} "
                            f"MB) and a buffer of {len(largest)} streamed layers ({sum(largest) / MB:.2f} MB) exceed "
                            f"the plan's frozen_resident_cap_bytes ({self.cap_bytes / MB:.2f} MB) on {self.device}; "
                            "recompile the plan")
        self.begin_step()

    def begin_step(self) -> None:
        """Start counting a new step (the buffer stays: it is within the cap)."""
        self.stats = StreamStats(0, self.resident_bytes())

    def weights(self, layer: int, slot: int) -> list[torch.Tensor]:
        """Linear ``slot`` of ``layer`` on the device (copied now if not resident), prefetching the next layer
        (hetero/stream_buffer.py decides what to copy and evict)."""
        copied, evicted = self._policy.use(layer, _in_backward())
        for i in evicted:
            del self._buffer[i]
        if copied:
            self._copy_in(copied)
        resident = self._buffer[layer]
        if resident.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(resident.event)
            for t in resident.tensors[slot]:
                t.record_stream(stream)  # freed on eviction only once the compute stream is past its use
        return resident.tensors[slot]

    def _copy_in(self, layers: list[int]) -> None:
        """Copy ``layers`` to the device (the evictions before them done), within the plan's cap."""
        total = self.resident_bytes() + sum(self.layer_bytes(i) for i in layers)
        if self.cap_bytes > 0 and total > self.cap_bytes:
            names = ", ".join(f"layers.{i}" for i in layers)
            raise PlanError(f"stage {self.stage}: streaming {names} would hold {total / MB:.2f} MB of frozen weights "
                            f"on {self.device}, over the plan's frozen_resident_cap_bytes ({self.cap_bytes / MB:.2f} "
                            "MB); recompile the plan")
        for i in layers:
            nbytes = self.layer_bytes(i)
            self._buffer[i] = self._copy(i, nbytes)
            self.stats.streamed_bytes += nbytes
        self.stats.frozen_resident_peak_bytes = max(self.stats.frozen_resident_peak_bytes, total)

    def copy_layer(self, layer: int) -> None:
        """Copy ``layer`` to the device once, outside the buffer, and wait for it: what `hetero profile` times."""
        resident = self._copy(layer, self.layer_bytes(layer))
        if resident.event is not None:
            resident.event.synchronize()

    def _copy(self, layer: int, nbytes: int) -> _Resident:
        """Host -> device into fresh tensors: on a CUDA side stream (non-blocking, from pinned memory) with an
        event, elsewhere synchronously."""
        context = torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()
        with context:
            copies = [[torch.empty_like(t, device=self.device).copy_(t, non_blocking=self.pinned) for t in h.tensors]
                      for h in self.layers[layer]]
            event = None
            if self._side is not None:
                event = torch.cuda.Event()
                event.record(self._side)
        return _Resident(copies, nbytes, event)


def _in_backward() -> bool:
    """Whether autograd is running a backward now (a recomputed layer's forward included): travel is l -> l-1."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class _StreamedMatmul(torch.autograd.Function):
    """y = x W^T (+ b) with W fetched from the streamer in forward and again in backward; saves nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, linear: StreamedLinear) -> torch.Tensor:
        ctx.linear = linear
        return linear.compute(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        weight = ctx.linear.dense_weight(grad.dtype)
        return grad.matmul(weight), None


class StreamedLinear(nn.Module):
    """A frozen Linear whose weights the stage's WeightStreamer holds: no parameter, no device copy between uses."""

    def __init__(self, streamer: WeightStreamer, layer: int, host: HostLinear, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.layer = layer
        self.slot = streamer.add(layer, host)
        self.streamer = streamer
        self.host = host

    @property
    def device(self) -> torch.device:
        """Where it computes (LoRA puts its adapter there)."""
        return self.streamer.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As the Linear it replaced (Linear4bit: computed in its compute dtype, returned in the input's)."""
        if self.host.compute_dtype is not None:
            return _StreamedMatmul.apply(x.to(self.host.compute_dtype), self).to(x.dtype)
        return _StreamedMatmul.apply(x, self)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The forward product with freshly fetched weights (called without grad, inside _StreamedMatmul)."""
        tensors = self.streamer.weights(self.layer, self.slot)
        bias = tensors[-1] if self.host.has_bias else None
        if self.host.nf4 is None:
            return F.linear(x, tensors[0], bias)
        import bitsandbytes as bnb

        if bias is not None:
            bias = bias.to(x.dtype)  # as Linear4bit casts its bias
        # Without grad, matmul_4bit runs the kernel Linear4bit's own training forward runs: the same numbers.
        return bnb.matmul_4bit(x, tensors[0], quant_state=self._state(tensors), bias=bias)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] on the device in ``dtype`` for the input gradient (NF4: dequantized, as bitsandbytes does)."""
        tensors = self.streamer.weights(self.layer, self.slot)
        if self.host.nf4 is None:
            return tensors[0].to(dtype)
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(tensors[0], self._state(tensors)).to(dtype)

    def _state(self, tensors: list[torch.Tensor]) -> Any:
        from bitsandbytes.functional import QuantState

        nf4 = self.host.nf4
        assert nf4 is not None
        return QuantState(absmax=tensors[1], shape=nf4["shape"], code=nf4["code"], blocksize=nf4["blocksize"],
                          quant_type=nf4["quant_type"], dtype=nf4["dtype"])


def _to_host(t: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A plain contiguous CPU copy of ``t`` (page-locked when the device is a CUDA one, so copies can overlap)."""
    t = t.data.as_subclass(torch.Tensor).detach().to("cpu").contiguous()  # a Params4bit's bytes, not the subclass
    return t.pin_memory() if pinned else t


def _is_linear4bit(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def host_linear(module: nn.Module, streamer: WeightStreamer) -> HostLinear | None:
    """A frozen Linear's tensors moved to host memory; None for any other module."""
    pinned = streamer.pinned
    bias = [] if getattr(module, "bias", None) is None else [_to_host(module.bias, pinned)]
    if type(module) is nn.Linear:
        return HostLinear([_to_host(module.weight, pinned), *bias], module.bias is not None)
    if not _is_linear4bit(module):
        return None
    state = module.weight.quant_state
    if state is None or state.nested:
        raise PlanError(f"stage {streamer.stage}: a NF4 layer is not quantized as hetero quantizes (no nested "
                        "statistics); it cannot be streamed")
    # Every Linear4bit trained through keeps the portable layout (runtime/stage/weights.py _nf4 says why).
    module.support_avx512bf16_for_cpu = False
    nf4 = {"shape": state.shape, "blocksize": state.blocksize, "quant_type": state.quant_type, "dtype": state.dtype,
           "code": state.code.to(streamer.device)}  # the 16-entry NF4 table: a constant, kept on the device
    return HostLinear([_to_host(module.weight, pinned), _to_host(state.absmax, pinned), *bias],
                      module.bias is not None, nf4, module.compute_dtype or state.dtype)


def stream_layer(layer: nn.Module, index: int, streamer: WeightStreamer) -> int:
    """Replace every frozen Linear of decoder layer ``index`` by a StreamedLinear; returns how many. A layer left
    with another weight matrix (a mixture of experts' unquantized 3-D experts) is refused in one line."""
    count = 0
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            host = host_linear(child, streamer)
            if host is not None:
                setattr(parent, name, StreamedLinear(streamer, index, host, child.in_features, child.out_features))
                count += 1
    left = [n for n, p in layer.named_parameters() if p.dim() >= 2]
    if left:
        raise PlanError(f"stage {streamer.stage}: layers.{index}.{left[0]} is not a Linear weight the runtime can "
                        "stream (a mixture of experts' experts stream only in NF4: model.quantization=nf4); "
                        "recompile with planner.offload=none")
    return count


def frozen_device_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s frozen tensors on its device (NF4: packed weights and absmax), each storage once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad or p.device.type == "meta":
            continue
        state = getattr(p, "quant_state", None)
        for t in (p, *(() if state is None else (state.absmax,))):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.nbytes
    return total
