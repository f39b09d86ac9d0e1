"""Attention that stays inside each packed record, for every family's decoder layers.

A packed row holds several records (runtime/run/data.py); its position ids restart at 0 where a record starts.
The stage passes the rows' segments to its layers as a keyword argument (``hetero_segments``), which transformers
hands through each decoder layer to the attention function of ``config._attn_implementation``. hetero registers
one such function per base implementation (``hetero_sdpa``, ``hetero_eager``, ``hetero_flash_attention_2``):
with segments it attends within each one; without (one record per row, the held-out evaluator) it calls the base
implementation unchanged, so padded training computes exactly what it computed before packing.

Within a segment, attention is what the family computes on that record alone: causal, the layer's sliding window
(a query sees the keys less than ``sliding_window`` positions back, as transformers' masks say), the attention
logit soft cap (Gemma 2), grouped key/value heads. No ``seq_len x seq_len`` mask is built: SDPA runs causal per
segment (a banded mask only for a segment longer than a sliding window), eager math per segment, and on CUDA with
flash-attn installed one variable-length kernel call over all segments.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hetero.runtime.wire.frames import accumulate_dtype

BASES = ("sdpa", "eager", "flash_attention_2", "flex_attention")
PREFIX = "hetero_"


@dataclass(frozen=True)
class Segments:
    """The records of each row of a micro-batch: per row, the (start, end) token spans, covering the row."""

    rows: tuple[tuple[tuple[int, int], ...], ...]
    _block_masks: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)  # flex, per window

    @property
    def longest(self) -> int:
        return max(end - start for row in self.rows for start, end in row)

    def cumulative(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Flash-attn's ``cu_seqlens`` over the flattened batch ``[B * S]``: int32 offsets of every segment."""
        edges = [b * seq_len + start for b, row in enumerate(self.rows) for start, _ in row]
        edges.append(len(self.rows) * seq_len)
        return torch.tensor(edges, dtype=torch.int32, device=device)


def segments_of(position_ids: torch.Tensor) -> Segments:
    """The segments of ``[B, S]`` position ids: a segment starts at column 0 and wherever the position is 0."""
    starts = (position_ids == 0).cpu()
    starts[:, 0] = True
    seq = position_ids.shape[1]
    rows = []
    for row in starts:
        edges = row.nonzero().flatten().tolist() + [seq]
        rows.append(tuple(zip(edges[:-1], edges[1:], strict=True)))
    return Segments(tuple(rows))


_WHOLE: dict[tuple[int, int], Segments] = {}


def _whole_rows(batch: int, seq: int) -> Segments:
    """One record per row (padding, if any, after it: causal attention never reads it), kept per shape so that the
    bucket layout is built once, not once per layer."""
    if (batch, seq) not in _WHOLE:
        _WHOLE[batch, seq] = Segments(tuple(((0, seq),) for _ in range(batch)))
    return _WHOLE[batch, seq]


def implementation(base: str) -> str:
    """The name hetero registers for ``base`` (a transformers attention implementation)."""
    if base not in BASES:
        raise ValueError(f"no packed attention for '{base}'")
    return PREFIX + base


def base_of(name: str) -> str:
    """The base implementation of a registered name (a name without the prefix is its own base)."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def register() -> None:
    """Register the packed attention functions and their masks with transformers (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for base in BASES:
        name = implementation(base)
        if name in ALL_ATTENTION_FUNCTIONS:
            continue
        ALL_ATTENTION_FUNCTIONS.register(name, _packed(base))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])


def _base_function(base: str, module: torch.nn.Module) -> Callable[..., Any]:
    if base == "eager":  # each modeling file has its own eager function (soft caps, sinks): the module's
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def _packed(base: str) -> Callable[..., Any]:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: int | None = None, softcap: float | None = None,
                  hetero_segments: Segments | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        sinks = getattr(module, "sinks", None)  # gpt-oss: its family runs eager attention only
        if sinks is not None:  # hetero's eager with the sink, one record per row unless packed (fp32 softmax)
            rows = hetero_segments or _whole_rows(query.shape[0], query.shape[2])
            return _per_segment("eager", query, key, value, rows, dropout, scaling, sliding_window, softcap,
                                sinks), None
        narrow = value.shape[-1] if value.shape[-1] < query.shape[-1] and base != "eager" else None
        if narrow is not None:  # latent attention's values are narrower than its queries (below)
            value = F.pad(value, (0, query.shape[-1] - narrow))
        out = _dispatch(base, module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                        hetero_segments, **kwargs)
        return (out if narrow is None else out[..., :narrow]), None

    attention.__name__ = f"packed_{base}"
    return attention


# Multi-head latent attention (DeepSeek) computes values narrower than its queries and keys (128 against 192 per
# head). The fused kernels take one head size (flash-attn, torch's CPU flash SDPA), and SDPA falls back to its math
# path otherwise: fp32 scores of every query and key, kept for backward. The values are padded with zeros to the
# query size, and the output cut back: exact (the padded columns compute zeros), the PV matmul half as wide again
# (compiler/costs.py attention_shape prices it so).


def _dispatch(base: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, sliding_window: int | None,
              softcap: float | None, hetero_segments: Segments | None, **kwargs: Any) -> torch.Tensor:
    if hetero_segments is None:
        if sliding_window is not None:
            kwargs["sliding_window"] = sliding_window
        if softcap is not None:
            kwargs["softcap"] = softcap
        return _base_function(base, module)(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, **kwargs)[0]
    if base == "flash_attention_2":
        return _flash_varlen(query, key, value, hetero_segments, dropout, scaling, sliding_window, softcap)
    if base == "flex_attention":
        return _flex(query, key, value, hetero_segments, scaling, sliding_window, softcap)
    return _per_segment(base, query, key, value, hetero_segments, dropout, scaling, sliding_window, softcap)


# Segments of about the same length share one attention call (``Buckets``): a bucket pads its segments to its
# longest, and the padding may cost at most this much over the segments' own causal work (sum of squared lengths).
# A GPU is bound by the calls it issues, not by attention's arithmetic (docs/gpu.md): few buckets. A CPU computes
# every padded position: at 1.2 a W7 micro-batch (docs/benchmarks.md) trains as fast as with a call per record.
BUCKET_WASTE = {"cuda": 2.0, "cpu": 1.2}


@dataclass(frozen=True)
class Buckets:
    """How a micro-batch's segments are laid out for one attention call per bucket, shared by every layer.

    ``gather`` (``[sum n_i * L_i]``) indexes the flattened ``[B * S]`` tokens into the buckets' rows, bucket after
    bucket (bucket i: ``[n_i, L_i]``): each segment from its first token, padded to ``L_i`` with the segment's own
    last token (a key after every real query, so causal attention never reads it). ``scatter`` (``[B * S]``) is
    where each token's output lies in the buckets' outputs, concatenated the same way."""

    shapes: tuple[tuple[int, int], ...]  # (segments, padded length) per bucket
    gather: torch.Tensor
    scatter: torch.Tensor


def buckets(segments: Segments, seq_len: int, device: torch.device, waste: float | None = None) -> Buckets:
    """Group the segments by length (longest first) so that each bucket's padded attention work is at most
    ``waste`` (default: ``BUCKET_WASTE`` of the device's type) times its segments' own; the index tensors are
    built once per micro-batch and device."""
    waste = waste if waste is not None else BUCKET_WASTE.get(torch.device(device).type, BUCKET_WASTE["cuda"])
    key = ("buckets", seq_len, str(device), waste)
    if key in segments._block_masks:
        return segments._block_masks[key]
    spans = sorted(((end - start, b * seq_len + start) for b, row in enumerate(segments.rows) for start, end in row),
                   key=lambda item: -item[0])
    groups: list[list[tuple[int, int]]] = []
    own = 0
    for length, first in spans:
        if groups:
            longest = groups[-1][0][0]
            if (len(groups[-1]) + 1) * longest * longest <= waste * (own + length * length):
                groups[-1].append((length, first))
                own += length * length
                continue
        groups.append([(length, first)])
        own = length * length
    shapes, gather = [], []
    scatter = torch.empty(len(segments.rows) * seq_len, dtype=torch.long)
    offset = 0
    for group in groups:
        longest = group[0][0]
        columns = torch.arange(longest)
        firsts = torch.tensor([first for _, first in group])
        lengths = torch.tensor([length for length, _ in group])
        index = firsts[:, None] + torch.minimum(columns[None, :], lengths[:, None] - 1)
        real = columns[None, :] < lengths[:, None]
        scatter[index[real]] = offset + real.flatten().nonzero().flatten()
        shapes.append((len(group), longest))
        gather.append(index.flatten())
        offset += index.numel()
    layout = Buckets(tuple(shapes), torch.cat(gather).to(device), scatter.to(device))
    segments._block_masks[key] = layout
    return layout


def _per_segment(base: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments,
                 dropout: float, scaling: float | None, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each segment alone; query ``[B, H, S, D]``, key/value ``[B, KV, S, D]`` -> ``[B, S, H, D]``.

    Segments of about the same length run as one batch (``buckets``): a few attention calls per layer however many
    records a row holds, where a call per segment would issue dozens of operators each (a GPU stage issuing
    kernels one by one is bound by that, not by arithmetic: docs/gpu.md). Tokens are gathered by index, whose
    backward adds each token's gradient once."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and (base == "eager" or softcap is not None):
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        groups = 1
    batch, heads, seq, dim = query.shape
    layout = buckets(segments, seq, query.device)
    # q, k and v gathered in one call: each token's heads flattened side by side, [tokens in bucket order,
    # H D + KV D + KV Dv] (multi-head latent attention's values are narrower than its queries and keys)
    qkv = torch.cat([t.transpose(1, 2).reshape(batch * seq, -1) for t in (query, key, value)], dim=1)
    rows = qkv.index_select(0, layout.gather).split([count * length for count, length in layout.shapes])
    outs: list[torch.Tensor] = []
    with _shape_free_kernels(query.device):
        _bucket_attention(base, layout, rows, outs, (heads, key.shape[1], dim, value.shape[-1]), groups, dropout,
                          scaling, window, softcap, sinks)
    merged = torch.cat(outs) if len(outs) > 1 else outs[0]
    return merged.index_select(0, layout.scatter).view(batch, seq, heads, value.shape[-1])


def _shape_free_kernels(device: torch.device) -> Any:
    """On CUDA, SDPA without its cuDNN backend: cuDNN builds an execution plan for every new shape, and buckets
    change shape with every micro-batch (bench/gpu_attention.py measures it); flash and memory-efficient kernels do
    not. The backends already enabled (torch's flags, an outer ``sdpa_kernel``) stay as they are, less cuDNN."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = [backend for backend, on in ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
                                           (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
                                           (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled())) if on]
    return sdpa_kernel(enabled) if enabled else contextlib.nullcontext()


def _bucket_attention(base: str, layout: Buckets, rows: tuple[torch.Tensor, ...], outs: list[torch.Tensor],
                      shape: tuple[int, int, int, int], groups: int, dropout: float, scaling: float | None,
                      window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> None:
    heads, kv_heads, dim, v_dim = shape  # query heads, key/value heads, query/key head size, value head size
    widths = ((heads, dim), (kv_heads, dim), (kv_heads, v_dim))
    for (count, length), row in zip(layout.shapes, rows, strict=True):
        parts = row.view(count, length, -1).split([n * d for n, d in widths], dim=2)
        q, k, v = (t.view(count, length, n, d).transpose(1, 2) for t, (n, d) in zip(parts, widths, strict=True))
        if base == "eager" or softcap is not None:
            out = _eager(q, k, v, dropout, scaling, window, softcap, sinks)
        else:
            mask = _window_mask(length, window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                                 scale=scaling, enable_gqa=groups > 1)
        outs.append(out.transpose(1, 2).reshape(count * length, heads, v_dim))


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """None (plain causal) unless a sliding window is shorter than the segment: then the banded boolean mask."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    back = i[:, None] - i[None, :]
    return (back >= 0) & (back < window)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scaling: float | None,
           window: int | None, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The eager attention transformers' modeling files compute, on one segment (heads already matched); ``sinks``
    (gpt-oss, one logit per head) join each query's softmax as one more key whose value is nothing."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    weights = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    length = q.shape[2]
    allowed = _window_mask(length, window, q.device)
    if allowed is None:
        allowed = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    weights = weights.masked_fill(~allowed, torch.finfo(weights.dtype).min)
    if sinks is not None:
        sink = sinks.to(weights.dtype).reshape(1, -1, 1, 1).expand(*weights.shape[:-1], 1)
        wide = accumulate_dtype(weights.dtype)  # float32 (float64 in a float64 plan, as transformers computes it there)
        weights = torch.softmax(torch.cat([weights, sink], dim=-1), dim=-1, dtype=wide)[..., :-1].to(q.dtype)
    else:
        weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, v)


def _flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments, dropout: float,
                  scaling: float | None, window: int | None, softcap: float | None) -> torch.Tensor:
    """flash-attn's variable-length kernel over every segment of the batch at once (CUDA, fp16/bf16)."""
    from flash_attn import flash_attn_varlen_func

    batch, heads, seq, dim = query.shape
    flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value)]
    edges = segments.cumulative(seq, query.device)
    longest = segments.longest
    out = flash_attn_varlen_func(*flat, edges, edges, longest, longest, dropout_p=dropout, softmax_scale=scaling,
                                 causal=True, window_size=(window - 1, 0) if window else (-1, -1),
                                 softcap=softcap or 0.0)
    return out.reshape(batch, seq, heads, dim)


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments, scaling: float | None,
          window: int | None, softcap: float | None) -> torch.Tensor:
    """torch's flex attention with a block mask of the segments (causal, within a record, inside the window)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, heads, seq, _ = query.shape
    cache_key = (window, seq, str(query.device))
    if cache_key not in segments._block_masks:  # once per micro-batch and window, not once per layer
        record = torch.zeros(batch, seq, dtype=torch.int32)
        for b, row in enumerate(segments.rows):
            for n, (start, end) in enumerate(row):
                record[b, start:end] = n
        record = record.to(query.device)

        def inside(b: Any, h: Any, q: Any, kv: Any) -> Any:
            allowed = (record[b, q] == record[b, kv]) & (q >= kv)
            return allowed & (q - kv < window) if window else allowed

        segments._block_masks[cache_key] = create_block_mask(inside, batch, None, seq, seq, device=query.device)

    def capped(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
        return torch.tanh(score / softcap) * softcap

    out = flex_attention(query, key, value, score_mod=capped if softcap else None,
                         block_mask=segments._block_masks[cache_key], scale=scaling,
                         enable_gqa=heads != key.shape[1])
    return out.transpose(1, 2).contiguous()


def flash_attn_installed() -> bool:
    """Whether flash-attn's package imports here."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def runtime_attention(configured: str, choice: str, device: torch.device | None, dtype: torch.dtype | None) -> str:
    """The base implementation a stage runs: the configured one (hetero/families.py), or under ``auto`` flash-attn
    where this CUDA stage computes in fp16/bf16 and has it installed; a choice this stage cannot run is one line."""
    from hetero.errors import PlanError

    half = dtype in (torch.float16, torch.bfloat16)
    on_gpu = device is not None and device.type == "cuda"
    if choice == "auto":
        return "flash_attention_2" if on_gpu and half and flash_attn_installed() else configured
    if device is None:  # building a config without a device (preloading): no check
        return configured
    if configured == "flash_attention_2":
        why = ("runs on " + device.type if not on_gpu else "computes in fp32" if not half
               else "has no flash-attn installed (pip install flash-attn)" if not flash_attn_installed() else "")
        if why:
            raise PlanError(f"model.attn_implementation=flash_attention_2: this stage {why}; flash-attn trains on "
                            "CUDA/ROCm GPUs in fp16/bf16 (use auto, sdpa or eager)")
    if configured == "flex_attention" and not on_gpu:
        raise PlanError(f"model.attn_implementation=flex_attention: this stage runs on {device.type}, where torch's "
                        "flex attention has no backward pass; use auto, sdpa or eager")
    return configured
