"""Per-unit costs of LoRA fine-tuning: parameter bytes, FLOPs per token, activation bytes per token.

Everything is counted from the module structure (each nn.Linear's in/out features, the attention
heads of the config), so the numbers follow the real architecture rather than a formula per family.
A test checks the FLOP counts against ``torch.utils.flop_counter`` and the activation estimate
against the tensors autograd actually saves for a peft-wrapped layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from hetero.errors import ConfigError
from hetero.families import SLIDING, attention_in_use, family, layer_types, needs_mask
from hetero.loss import head_bytes_per_token
from hetero.specs import BYTES_PER_DTYPE, QUANT_BYTES_PER_PARAM

# Quantized Linear weights cost hetero.specs.QUANT_BYTES_PER_PARAM; everything that is not a decoder
# Linear weight stays at the compute dtype.
# peft keeps LoRA A/B in fp32 (autocast_adapter_dtype); the A-output (r values per token) is fp32.
LORA_BYTES = 4
# FlashAttention-style backward recomputes the score matrix: 5 matmuls of the forward's 2 -> 2.5x.
ATTENTION_BWD_FACTOR = 2.5


@dataclass
class UnitCost:
    num_params: int
    linear_params: int
    param_bytes: float
    lora_params: int
    fwd_flops_per_token: float
    bwd_flops_per_token: float
    activation_bytes_per_token: float
    recompute_bytes_per_token: float | None = None  # kept per token when recomputed (decoder layers only)
    expert_params: int = 0  # of linear_params, the mixture-of-experts weights (every expert)
    layer_type: str = ""  # a decoder layer's attention kind (hetero/families.py layer_types)
    dispatch_bytes_per_token: float = 0.0  # a mixture of experts' routing traffic (MoE.dispatch_bytes)


@dataclass(frozen=True)
class MoE:
    """A decoder layer's mixture of experts, as its costs need it: ``top_k`` of ``experts`` gated MLPs of
    ``intermediate`` per token, ``params`` in all (every expert: what memory holds)."""

    experts: int
    top_k: int
    params: int
    hidden: int
    grouped: bool = True  # model.experts_implementation: grouped (sorted once), or eager (transformers' loop)
    gate_kept: int = 3  # intermediates of I per chosen expert its gate keeps (hetero/families.py Experts.gate_kept)
    shared: int = 0  # the intermediate size of the shared experts every token runs (Qwen2-MoE, GLM-4.5, DeepSeek)
    shared_gated: bool = False  # the shared experts' output scaled by a sigmoid gate per token (Qwen2-MoE)

    @property
    def intermediate(self) -> int:  # gate, up [I, H] and down [H, I] per expert
        return self.params // (self.experts * 3 * self.hidden)

    def flops_per_token(self) -> float:
        """Forward FLOPs per token: the router's logits over every expert, then the top-k experts' matmuls only."""
        return 2.0 * self.experts * self.hidden + 2.0 * self.top_k * self.params / self.experts

    def dispatch_bytes(self, dtype_bytes: float) -> float:
        """Forward memory traffic per token of the routing around the experts' matmuls (memory-bound kernels that
        run beside them, not under them): the token's rows gathered per chosen expert (read H, write k H), weighted
        (read and write k H), put back in token order (read and write k H) and summed (read k H, write H), and the
        sort's int64 keys, order and inverse order."""
        return float(dtype_bytes * (2 + 7 * self.top_k) * self.hidden + 4 * 8 * self.top_k)

    def activation_bytes(self, dtype_bytes: float) -> float:
        """What autograd keeps per token for the MoE block (frozen experts), as measured in tests/unit/test_experts.py.
        Grouped: per chosen expert its gathered input (H), the gate/up output and the activation (``gate_kept`` I:
        3 for SwiGLU, 6 for gpt-oss's clamped one), the routing
        weight, its top-k value (fp32) and index, and three int64 row indices (the sort's order, the rows' tokens,
        the inverse order); the router's input (H), its fp32 logits over every expert and one scalar. Eager
        (transformers' per-expert loop): per chosen expert also its output (H), two int64 indices, and the router's
        softmax over every expert. NF4 experts keep no input (bitsandbytes saves the weight only): an overestimate
        of H per chosen expert."""
        # Shared experts: a plain SwiGLU MLP (its gate and up outputs, the activation), and where gated its output
        # and the gate's sigmoid.
        shared = dtype_bytes * (3 * self.shared + (self.hidden + 1 if self.shared_gated else 0))
        if self.grouped:
            per_expert = dtype_bytes * (self.gate_kept * self.intermediate + self.hidden + 1) + 3 * 8 + 4 + 8
            router = dtype_bytes * self.hidden + 4 * self.experts + 4
            return float(self.top_k * per_expert + router + shared)
        per_expert = dtype_bytes * (self.gate_kept * self.intermediate + 2 * self.hidden + 1) + 2 * 8
        router = dtype_bytes * self.hidden + 2 * 4 * self.experts + (4 + 8) * self.top_k + 4
        return float(self.top_k * per_expert + router + shared)


@dataclass(frozen=True)
class Traits:
    """What sets one decoder layer's costs apart beyond its Linear layers (hetero/families.py): its attention
    kind, whether its attention gets a mask tensor (then the kernel computes every key: no causal skip), whether
    it is eager (it keeps the probabilities) with soft-capped scores, the bytes its norms keep, its experts."""

    layer_type: str = "full_attention"
    masked: bool = False
    eager: bool = False
    softcap: bool = False
    norm_bytes: float | None = None  # None: two hidden-size RMSNorms
    moe: MoE | None = None
    fused_qkv: bool = False  # one qkv_proj (Phi-3): the v that attention keeps is a view of all of q, k and v
    mlp_inter: int | None = None  # a dense MLP's width where it is not config.intermediate_size (Llama 4's dense layers)


def layer_traits(config: Any, index: int, seq_len: int, module: nn.Module, params: dict[str, Any]) -> Traits:
    """The Traits of decoder layer ``index`` (``module``, parameters ``params``) at ``seq_len``."""
    fam = family(getattr(config, "model_type", None))
    kind = layer_types(config)[index]
    eager = attention_in_use(fam, config) == "eager"
    return Traits(layer_type=kind, masked=needs_mask(fam, config, kind, seq_len), eager=eager,
                  softcap=eager and bool(getattr(config, "attn_logit_softcapping", None)),
                  norm_bytes=norm_bytes(config, module), moe=layer_moe(config, params),
                  fused_qkv=any(name.endswith("qkv_proj") for name, _ in module.named_modules()),
                  mlp_inter=next((m.in_features for name, m in module.named_modules()
                                  if name.endswith("down_proj") and isinstance(m, nn.Linear)), None))


def norm_bytes(config: Any, module: nn.Module) -> float:
    """Per token, what the layer's RMSNorms keep (HF computes them in fp32): the fp32 upcast of each input and
    its per-row rsqrt. A norm of the hidden size reads the hidden state; a smaller one (Qwen3's and Gemma 3's q/k
    norms: per head; OLMo 2's: the whole projection) reads the query or key projection, row by row; a latent's (MLA)
    its own width. Llama 4's weightless L2 norm keeps q and k per head alike."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    width = {"q_norm": heads * head_dim, "k_norm": config.num_key_value_heads * head_dim}
    total = 0.0
    for name, sub in module.named_modules():
        weight = getattr(sub, "weight", None)
        # Llama 4's q/k norm without a weight (transformers 5.25 renamed Llama4TextL2Norm): q and k per head, in fp32
        if type(sub).__name__.endswith(("L2Norm", "WeightlessRMSNorm")):
            q, k = width["q_norm"], width["k_norm"]
            total += 4 * (q + k) + 4 * (heads + config.num_key_value_heads)
        if not type(sub).__name__.endswith("RMSNorm") or weight is None:
            continue
        size = int(weight.numel())
        elements = width.get(name.rsplit(".", 1)[-1], size) if size != h else h
        total += 4 * elements + 4 * (elements // size)
    return total


def layer_moe(config: Any, params: dict[str, Any]) -> MoE | None:
    """The mixture of experts of a decoder layer with parameters ``params`` (None: a dense layer): its family's
    experts (hetero/families.py) are the 3-D tensors [experts, out, in] under the layer's experts module."""
    experts = family(getattr(config, "model_type", None)).experts
    if experts is None:
        return None
    inside = {name: t for name, t in params.items() if f".{experts.module}." in name}
    stacked = sum(int(t.numel()) for t in inside.values() if t.dim() == 3)
    if not stacked and inside:
        raise ConfigError(f"this transformers keeps the {config.model_type} experts as separate modules; hetero "
                          "counts and quantizes the fused 3-D experts of transformers 5: pip install 'transformers>=5'")
    if not stacked:
        return None  # a dense layer of a MoE model (Qwen3-MoE's mlp_only_layers)
    count, top_k = int(getattr(config, experts.count)), int(getattr(config, experts.top_k))
    grouped = (getattr(config, "hetero_experts", None) or getattr(config, "_experts_implementation", None)) != "eager"
    # Shared experts: the gate projections of the block outside the routed experts ([I, H] each; the block is the
    # experts' parent: mlp, or Llama 4's feed_forward).
    block = f".{experts.module.rpartition('.')[0]}."
    outside = {name: t for name, t in params.items() if block in name and name not in inside}
    shared = sum(int(t.shape[0]) for name, t in outside.items() if name.endswith("gate_proj.weight") and t.dim() == 2)
    gated = any(name.endswith("shared_expert_gate.weight") for name in outside)
    return MoE(count, top_k, stacked, int(config.hidden_size), grouped, experts.gate_kept, shared, gated)


def lora_targets(module: nn.Module, prefix: str, targets: Iterable[str]) -> list[tuple[str, nn.Linear | nn.Embedding]]:
    """The (full name, module) pairs peft would wrap with LoRA: names equal to or ending in a target."""
    targets = list(targets)
    found: list[tuple[str, nn.Linear | nn.Embedding]] = []
    for name, sub in module.named_modules():
        full = (prefix + name).rstrip(".")
        if not isinstance(sub, (nn.Linear, nn.Embedding)):
            continue
        if any(full == t or full.endswith("." + t) for t in targets):
            found.append((full, sub))
    return found


def _lora_shape(sub: nn.Linear | nn.Embedding) -> tuple[int, int]:
    if isinstance(sub, nn.Linear):
        return sub.in_features, sub.out_features
    return sub.num_embeddings, sub.embedding_dim  # nn.Embedding: A is r x num_embeddings, B is dim x r


@dataclass(frozen=True)
class AttentionShape:
    """The widths per token (summed over heads) of what a decoder layer's attention computes: one head's query/key
    size (``qk``), the keys and values the kernel reads (``k``, ``v``: its output is as wide as ``v`` over the query
    heads) and o_proj's input (``out``)."""

    heads: int
    qk: int
    k: int
    v: int
    out: int
    latents: tuple[tuple[str, int], ...] = ()  # LoRA input groups of latent projections (MLA): (group, width)

    @property
    def kernel_out(self) -> int:
        return self.heads * self.v // max(1, self.k // self.qk)


def attention_shape(config: Any, eager: bool = False) -> AttentionShape:
    """The attention widths of ``config``: grouped-query attention, or multi-head latent attention (DeepSeek: q and
    k of nope + rope per head, k and v expanded per head from a latent; except under ``eager`` attention the runtime
    pads the narrower values to the query size for the fused kernels, runtime/stage/attention.py, and o_proj reads
    them cut back)."""
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        latents = [("kv_latent", int(config.kv_lora_rank))]
        if getattr(config, "q_lora_rank", None):
            latents.append(("q_latent", int(config.q_lora_rank)))
        v = heads * (config.v_head_dim if eager else qk)
        return AttentionShape(heads, qk, heads * qk, v, heads * config.v_head_dim, tuple(latents))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = config.num_key_value_heads * head_dim
    return AttentionShape(heads, head_dim, kv, kv, heads * head_dim)


def attention_flops_per_token(config: Any, seq_len: int, causal: bool = True, eager: bool = False) -> float:
    """QK^T and PV of one layer, per token; causal kernels skip the masked half (average (S+1)/2 keys); with a
    mask tensor (eager attention, a sliding window shorter than the sequence) every key is computed."""
    shape = attention_shape(config, eager)
    keys = (seq_len + 1) / 2 if causal else seq_len
    return 2 * (shape.heads * shape.qk + shape.kernel_out) * keys


# Which Linears read the same input tensor: a LoRA on any of them keeps that input once (the runtime's
# LoRA path saves the input at the compute dtype, shared; see runtime/stage/lora.py).
_INPUT_GROUPS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
                 "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_mid",
                 "qkv_proj": "attn_in", "gate_up_proj": "mlp_in",  # Phi-3's fused projections
                 # latent attention (MLA): into the latents, and from the normed latents per head
                 "q_a_proj": "attn_in", "kv_a_proj_with_mqa": "attn_in", "q_b_proj": "q_latent",
                 "kv_b_proj": "kv_latent"}


def decoder_activation_bytes(config: Any, targeted: set[str], dtype_bytes: float, lora_r: int,
                             lora_dropout: float = 0.0, traits: Traits | None = None, seq_len: int = 0) -> float:
    """Bytes autograd keeps per token for one decoder layer under LoRA (no recomputation).

    Frozen Linears (also nf4: bitsandbytes keeps only the weight) keep no input (grad_input =
    grad_out @ W). A LoRA'd Linear keeps its input at the compute dtype, once per distinct input
    (q/k/v share the attention's normed input, gate/up the MLP's), plus its fp32 A-output (r
    values) that B's weight grad needs; with lora.dropout > 0 each LoRA'd Linear keeps its own
    fp32 dropped-out copy and a one-byte mask instead. The rest is what the ops themselves keep:
    - RMSNorm: the fp32 upcast of its input and the per-token rsqrt (HF computes the norm in fp32): two of the
      hidden size, or those the layer has (norm_bytes: Gemma's four, q/k norms);
    - sdpa (flash / memory-efficient): q, k, v (k/v at KV-head size: GQA runs without repeat_kv), the
      output and an fp32 logsumexp per head; eager attention (Gemma 2): q and the repeated k and v, and per
      head a row of the score matrix over every key, fp32 from the softmax and its cast (and the tanh of
      soft-capped scores);
    - MLP: gate output (SiLU's input), SiLU output and up output (both operands of the product); a mixture of
      experts keeps that per chosen expert, and its router's (MoE.activation_bytes).
    Rotary cos/sin are per sequence, not per token, and are left out.
    """
    h = config.hidden_size
    traits = traits or Traits()
    shape = attention_shape(config, traits.eager)
    heads, q_dim = shape.heads, shape.heads * shape.qk
    inter = traits.mlp_inter or config.intermediate_size  # the dense or shared MLP's down_proj input
    in_features = {"attn_in": h, "attn_out": shape.out, "mlp_in": h, "mlp_mid": inter, **dict(shape.latents)}
    lora_linears = [t for t in targeted if t in _INPUT_GROUPS]
    norms = 2 * (4 * h + 4) if traits.norm_bytes is None else traits.norm_bytes
    lora = LORA_BYTES * lora_r * len(lora_linears)
    if lora_dropout > 0:
        lora += sum((LORA_BYTES + 1) * in_features[_INPUT_GROUPS[t]] for t in lora_linears)
    else:
        lora += sum(dtype_bytes * in_features[g] for g in {_INPUT_GROUPS[t] for t in lora_linears})
    if traits.eager:  # k and v repeated to every query head
        scores = heads * seq_len * (4 + dtype_bytes * (2 if traits.softcap else 1))
        attention = dtype_bytes * (2 * q_dim + shape.kernel_out) + scores
    else:
        attention = dtype_bytes * (q_dim + shape.k + shape.v + shape.kernel_out) + 4 * heads
    if traits.fused_qkv:
        attention += dtype_bytes * (q_dim + shape.k)
    mlp = dtype_bytes * 3 * inter if traits.moe is None else traits.moe.activation_bytes(dtype_bytes)
    return float(norms + lora + attention + mlp)


def decoder_recompute_bytes(config: Any, dtype_bytes: float) -> float:
    """Bytes per token a recomputed decoder layer keeps between its forward and backward: its input.

    The layer re-runs its forward during backward (runtime/stage/model.py); while it does, one layer's
    full activations exist again, which the planner adds once per stage (planner/model/objective.py).
    """
    return float(dtype_bytes * config.hidden_size)


def unit_cost(
    kind: str,
    module: nn.Module,
    prefix: str,
    params: dict[str, Any],
    config: Any,
    seq_len: int,
    dtype: str,
    quantization: str,
    lora_r: int,
    lora_target_names: list[str],
    lora_dropout: float = 0.0,
    layer_index: int = 0,
    attention_len: float | None = None,
    label_share: float | None = None,
) -> UnitCost:
    """Costs of one pipeline unit; ``params`` maps its state-dict names to (meta) tensors; ``layer_index``: a
    decoder layer's index in the model; ``attention_len``: packed rows (attention inside each record) are priced
    as causal attention over this many tokens (None: rows of seq_len); ``label_share``: the share of tokens the loss
    head computes logits for (None: every token)."""
    dtype_bytes = BYTES_PER_DTYPE[dtype]
    if quantization not in ("none", *QUANT_BYTES_PER_PARAM):
        raise ConfigError(f"model.quantization={quantization!r} is not one of none, nf4, int8")
    num_params = sum(int(t.numel()) for t in params.values())
    linears = [m for _, m in module.named_modules() if isinstance(m, nn.Linear)]
    traits = layer_traits(config, layer_index, seq_len, module, params) if kind == "decoder" else Traits()
    if attention_len and kind == "decoder":  # per record: causal SDPA (eager math computes its every key)
        traits = replace(traits, masked=traits.eager)
    moe = traits.moe
    # Only decoder Linear weights (and experts: runtime/stage/weights.py quantizes them per expert) are quantized;
    # the head stays in the compute dtype (as bitsandbytes does).
    linear_params = sum(m.in_features * m.out_features for m in linears) if kind == "decoder" else 0
    linear_params += moe.params if moe else 0
    weight_bytes_q = QUANT_BYTES_PER_PARAM.get(quantization, dtype_bytes)
    param_bytes = (num_params - linear_params) * dtype_bytes + linear_params * weight_bytes_q
    targets = lora_targets(module, prefix, lora_target_names)
    fwd, bwd, act, recompute = _work_per_token(kind, linears, targets, config, seq_len, dtype_bytes, lora_r,
                                               lora_dropout, traits, attention_len, label_share)
    return UnitCost(
        num_params=num_params,
        linear_params=linear_params,
        param_bytes=float(param_bytes),
        lora_params=sum(lora_r * sum(_lora_shape(m)) for _, m in targets),
        fwd_flops_per_token=float(fwd),
        bwd_flops_per_token=float(bwd),
        activation_bytes_per_token=act,
        recompute_bytes_per_token=recompute,
        expert_params=moe.params if moe else 0,
        layer_type=traits.layer_type if kind == "decoder" else "",
        dispatch_bytes_per_token=moe.dispatch_bytes(dtype_bytes) if moe else 0.0,
    )


def _work_per_token(
    kind: str,
    linears: list[nn.Linear],
    targets: list[tuple[str, nn.Linear | nn.Embedding]],
    config: Any,
    seq_len: int,
    dtype_bytes: float,
    lora_r: int,
    lora_dropout: float,
    traits: Traits,
    attention_len: float | None = None,
    label_share: float | None = None,
) -> tuple[float, float, float, float | None]:
    """(forward FLOPs, backward FLOPs, activation bytes, recompute bytes) per token of a unit of ``kind``."""
    lora_fwd = sum(2 * lora_r * sum(_lora_shape(m)) for _, m in targets if isinstance(m, nn.Linear))
    matmul_fwd = sum(2 * m.in_features * m.out_features for m in linears)
    matmul_fwd += traits.moe.flops_per_token() if traits.moe else 0.0  # the router, only the experts a token uses
    h = config.hidden_size
    if kind == "decoder":
        span = min(attention_len or seq_len, seq_len)
        attn = attention_flops_per_token(config, span, causal=not traits.masked, eager=traits.eager)
        window = getattr(config, "sliding_window", None)
        if attention_len and window and traits.layer_type == SLIDING and \
                attention_in_use(family(config.model_type), config) in ("flash_attention_2", "flex_attention"):
            # These kernels skip what the window leaves out; per-record SDPA computes a long record's band whole.
            attn = min(attn, attention_flops_per_token(config, 2 * int(window) - 1, causal=True, eager=traits.eager))
        # Input grads through the frozen matmuls (~1x), attention backward, LoRA input + weight grads (2x).
        bwd = matmul_fwd + ATTENTION_BWD_FACTOR * attn + 2 * lora_fwd
        short = {name.rsplit(".", 1)[-1] for name, _ in targets}
        # Memory at seq_len, not the mean: a step may hold a record as long as a row (eager keeps its scores).
        act = decoder_activation_bytes(config, short, dtype_bytes, lora_r, lora_dropout, traits, seq_len)
        return matmul_fwd + attn + lora_fwd, bwd, act, decoder_recompute_bytes(config, dtype_bytes)
    if kind == "head":
        # The loss runs in chunks of label tokens (hetero/loss.py): a token keeps its hidden state for backward, and
        # one chunk's logits (stage dtype, fp32 copy, its gradient) exist at a time, not (b+8)V per token.
        # A frozen head (no LoRA on it) computes each chunk's input gradient in forward, while its logits exist:
        # forward runs the matmul twice (logits, gradient), backward only scales that gradient. With LoRA on the head,
        # backward computes the chunk's logits again, then the gradients. Only label tokens get logits: per computed
        # token, the label share of that work.
        act = head_bytes_per_token(h, int(config.vocab_size), dtype_bytes, seq_len)
        share = 1.0 if label_share is None else label_share
        if not targets:
            return share * 2 * matmul_fwd, share * 2.0 * h, act, None
        return share * (matmul_fwd + lora_fwd), share * (2 * matmul_fwd + 2 * lora_fwd), act, None
    if kind == "norm":
        return 4.0 * h, 8.0 * h, float(4 * h + 4), None  # square, mean, rsqrt-scale, weight: elementwise, tiny
    # embedding: a gather, nothing to differentiate (frozen, integer input)
    if targets:  # LoRA on the embedding: a gather from A plus a small matmul with B
        return 2.0 * lora_r * h, 4.0 * lora_r * h, float(LORA_BYTES * lora_r), None
    return 0.0, 0.0, 0.0, None
