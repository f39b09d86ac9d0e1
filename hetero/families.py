"""The model families hetero splits, as data: one entry per Hugging Face ``model_type`` (torch-free).

Every family here is a CausalLM of ``model.embed_tokens``, ``model.rotary_emb``, ``model.layers``,
``model.norm`` and ``lm_head`` whose decoder layer takes (hidden states, attention_mask, position_ids,
position_embeddings). What differs between families is written in the entry, and read by the compiler
(compiler/fxgraph.py: which model_types it traces), the runtime's stage builder (runtime/stage/model.py: the
model forward's steps outside the layers) and the LoRA checks (which Linear layers LoRA may target):

- ``embed_scale``: the model forward multiplies the embeddings by a number: the config key that holds it,
  or ``sqrt_hidden`` for sqrt(hidden_size);
- ``logits_divisor``: the CausalLM divides the logits by this config key's value; ``logits_softcap``: it
  soft-caps them at this config key's value;
- ``attention``: the attention implementation the family trains with; other than SDPA, each layer gets the
  explicit causal or sliding-window mask of its kind (``config.layer_types``);
- ``rotary_per_layer_type``: the rotary embedding is called with each layer's kind and gives each its own
  cos/sin;
- ``experts``: a mixture-of-experts family: the config keys of its expert count and top-k, and how checkpoints
  store the experts that transformers fuses into 3-D tensors (read by the cost model, compiler/costs.py, the
  weight loader and NF4, runtime/stage/weights.py and experts.py);
- ``lora_targets``: the Linear layers of a decoder layer LoRA may target, by name (the compiler names them
  when `lora.target_modules` matches nothing);
- ``sinks``: a learned logit per attention head joins every softmax (gpt-oss): eager attention only, with the
  sink added per packed record (runtime/stage/attention.py);
- ``rotary_complex``: the rotary embedding gives one complex tensor per position (DeepSeek's freqs_cis) that the
  layers take as their position embeddings (the compiler's trace, compiler/fxgraph.py).

Parameters, FLOPs and activation bytes are counted from the module structure (compiler/costs.py), so a
family needs no formula of its own (a mixture of experts counts every expert in memory and top-k in compute).
Adding a family is one entry here plus its row in the equivalence test (tests/unit/test_families.py) and
docs/models.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hetero.errors import ConfigError, UnsupportedModelError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# model.attn_implementation: auto = the family's (below), or flash-attn where a CUDA stage has it installed (never
# for a family with attention sinks).
ATTENTION_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")
# model.experts_implementation of a mixture of experts: grouped = tokens sorted by expert once, then grouped matmuls
# (runtime/stage/experts.py); eager = transformers' loop with a host sync per expert (the reference).
EXPERTS_CHOICES = ("grouped", "eager")
MLP = ("gate_proj", "up_proj", "down_proj")
# Multi-head latent attention (DeepSeek-V2/V3): q straight (q_proj) or through a latent (q_a_proj, q_b_proj); k and v
# from one shared latent (kv_a_proj_with_mqa, which also carries the rotary part of k), expanded per head (kv_b_proj).
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts decoder layer: HF keeps its experts as fused 3-D tensors [experts, out, in] under
    ``module``; checkpoints (the hub's, and transformers' save_pretrained) store one 2-D weight per expert."""

    count: str  # config key: experts per layer
    top_k: str  # config key: experts each token uses
    # Per fused tensor (layer-relative name): the checkpoint keys of expert {e}'s parts, concatenated along dim 0.
    stored: tuple[tuple[str, tuple[str, ...]], ...]
    # Other layer-relative names the checkpoint spells differently (Mixtral's router): (HF name, stored name).
    renamed: tuple[tuple[str, str], ...] = ()
    module: str = "mlp.experts"
    # What its gate keeps for backward per chosen expert, in units of the expert's intermediate size: SwiGLU keeps
    # the gate/up output (2 I) and the activation (I); gpt-oss's clamped SwiGLU also its clamped gate, sigmoid and
    # up + 1 (6 I; tests/unit/test_experts.py measures both).
    gate_kept: int = 3
    # How the family's published checkpoints store the experts when not as weights of the compute dtype (gpt-oss:
    # "MXFP4"); runtime/stage/weights.py dequantizes them on loading.
    stored_format: str | None = None
    # The router's weight scales each chosen expert's input, not its output, and transformers computes every expert
    # for every token (Llama 4): the stage computes the chosen ones only (runtime/stage/routed.py).
    scaled_input: bool = False
    # transformers keeps the fused experts input-major ([E, in, out]: gpt-oss, Llama 4), not [E, out, in].
    transposed: bool = False


@dataclass(frozen=True)
class SeqLimit:
    """A config key that bounds the sequence a family computes as plain causal attention here: ``seq_len`` may be at
    most its value + ``offset`` (transformers' ``default`` where the config leaves the key out; a null value: no
    limit). ``switch``: a boolean config key (true by default) without which the limit does not apply."""

    key: str
    default: int
    what: str  # what it bounds, for the refusal
    offset: int = 0
    switch: str | None = None

    def of(self, architecture: dict[str, Any]) -> int | None:
        """The longest plain-causal sequence this key allows (None: no limit); ValueError where it is no integer."""
        if self.switch is not None and not architecture.get(self.switch, True):
            return None
        value = architecture.get(self.key, self.default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or int(value) != value:
            raise ValueError(self.key)
        return int(value) + self.offset


@dataclass(frozen=True)
class Family:
    model_type: str
    examples: str  # the checkpoints people fine-tune, for docs and errors
    lora_targets: tuple[str, ...] = ATTENTION + MLP
    embed_scale: str | None = None  # a config key, or "sqrt_hidden"
    logits_divisor: str | None = None  # a config key
    logits_softcap: str | None = None  # a config key: logits = cap * tanh(logits / cap)
    # The attention implementation HF trains the family with. "sdpa" runs causal without a mask tensor; any other
    # gets the causal (and sliding-window) masks of its layers' kinds (config.layer_types) built per stage.
    attention: str = "sdpa"
    # The rotary embedding takes the layer's kind (config.layer_types) and gives each kind its own cos/sin
    # (Gemma 3: another base frequency for its sliding-window layers).
    rotary_per_layer_type: bool = False
    experts: Experts | None = None  # a mixture-of-experts family
    # Where a checkpoint keeps this family's tensors under other names: (HF prefix, stored prefix) pairs tried in
    # order (Gemma 3's multimodal checkpoints keep the language model under language_model.).
    stored_prefixes: tuple[tuple[str, str], ...] = ()
    # The model_type of a multimodal config.json whose text_config is this family's (Gemma 3 4B-27B: gemma3).
    text_of: str | None = None
    # Attention sinks (gpt-oss): a learned logit per head joins every softmax. Eager attention only: SDPA and
    # flash-attn have no such term (runtime/stage/attention.py adds it per packed record).
    sinks: bool = False
    # The rotary embedding gives one complex tensor (DeepSeek's freqs_cis), not a cos/sin pair.
    rotary_complex: bool = False
    # Multi-head latent attention: the config key that, when set, sends q through a latent (q_a_proj, q_b_proj; no
    # q_proj), when null straight through q_proj (DeepSeek-V2-Lite).
    latent_q: str | None = None
    # What bounds the sequence it computes as plain causal attention, packed or not (Llama 4: its chunked layers
    # attend within chunks of attention_chunk_size; its layers without rotary scale queries from floor_scale - 1 on).
    seq_limits: tuple[SeqLimit, ...] = ()

    def lora_targets_of(self, config: Any) -> tuple[str, ...]:
        """The Linear layers of a decoder layer LoRA may target in this model (a built config or an architecture
        dict): the family's, less the query path its config does not build."""
        if self.latent_q is None:
            return self.lora_targets
        value = config.get(self.latent_q) if isinstance(config, dict) else getattr(config, self.latent_q, None)
        absent = ("q_proj",) if value else ("q_a_proj", "q_b_proj")
        return tuple(t for t in self.lora_targets if t not in absent)

    def attention_impl(self, config: Any, choice: str = "auto") -> str:
        """The attention implementation a model of this family trains with under ``model.attn_implementation``:
        for ``auto`` the family's, or eager where the config soft-caps attention logits (SDPA cannot); otherwise the
        choice, refused in one line where the family cannot use it."""
        softcap = getattr(config, "attn_logit_softcapping", None)
        if choice not in ATTENTION_CHOICES:
            raise ConfigError(f"model.attn_implementation={choice!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
        if self.sinks and choice not in ("auto", "eager"):
            raise ConfigError(f"model.attn_implementation={choice}: this {self.model_type} model adds a learned sink "
                              "logit to every attention softmax, which only eager attention computes; use auto or "
                              "eager")
        if choice == "auto":
            return "eager" if softcap else self.attention
        if choice == "sdpa" and softcap:
            raise ConfigError(f"model.attn_implementation=sdpa: this {self.model_type} model soft-caps its attention "
                              "logits (attn_logit_softcapping), which SDPA cannot; use auto, eager, flash_attention_2 "
                              "or flex_attention")
        return choice

    def configure(self, config: Any, choice: str = "auto", experts: str = "grouped") -> None:
        """Set a built HF config to compute as hetero trains the family: its attention implementation, and for a
        mixture of experts ``model.experts_implementation``: grouped (transformers' grouped_mm: one routing pass,
        no host sync; a stage without a fast grouped GEMM, and NF4Experts, sort the rows the same way and read the
        expert counts once: runtime/stage/experts.py) or eager (transformers' per-expert loop)."""
        config._attn_implementation = self.attention_impl(config, choice)
        if experts not in EXPERTS_CHOICES:
            raise ConfigError(f"model.experts_implementation={experts!r}: expected one of {', '.join(EXPERTS_CHOICES)}")
        if self.experts is not None and self.experts.scaled_input:
            if experts == "eager":  # transformers' block computes every expert for every token: not what is priced
                raise ConfigError(f"model.experts_implementation=eager: this {self.model_type} model's transformers "
                                  "block runs every expert on every token; hetero runs the chosen ones, use grouped")
            config.hetero_experts = "grouped_mm"
        elif self.experts is not None:
            config._experts_implementation = "grouped_mm" if experts == "grouped" else "eager"

    def embedding_multiplier(self, architecture: dict[str, Any]) -> float:
        """What the model forward multiplies the embeddings by (1.0: nothing)."""
        if self.embed_scale is None:
            return 1.0
        if self.embed_scale == "sqrt_hidden":
            return float(architecture["hidden_size"]) ** 0.5
        return float(architecture.get(self.embed_scale, 1.0))

    def logits_scale(self, architecture: dict[str, Any]) -> float:
        """What the CausalLM divides the logits by (1.0: nothing)."""
        return 1.0 if self.logits_divisor is None else float(architecture.get(self.logits_divisor, 1.0))

    def softcap(self, config: Any) -> float | None:
        """The final logits' soft cap (None: none), from the built HF config (its defaults included)."""
        value = getattr(config, self.logits_softcap, None) if self.logits_softcap else None
        return float(value) if value else None


# How most checkpoints store fused experts: one gate, up and down weight per expert (Qwen-MoE, OLMoE, GLM-4.5).
PER_EXPERT = (("mlp.experts.gate_up_proj", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
              ("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)))

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama 3.x, SmolLM, TinyLlama"),
    Family("mistral", "Mistral 7B, Mistral-Nemo"),
    Family("qwen2", "Qwen2.5"),
    Family("qwen3", "Qwen3 (dense)"),
    Family("olmo2", "OLMo 2"),
    Family("phi3", "Phi-3, Phi-4", lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("granite", "Granite 3.x", embed_scale="embedding_multiplier", logits_divisor="logits_scaling"),
    # Embeddings scaled inside its embedding module; sliding-window and global layers alternate; attention
    # logits soft-capped inside the layer (eager attention), final logits soft-capped by the CausalLM.
    Family("gemma2", "Gemma 2", logits_softcap="final_logit_softcapping", attention="eager"),
    # Gemma 3's text model (the language half of the 4B-27B checkpoints, and the 1B): like Gemma 2 without the
    # attention soft-cap (so SDPA, with the sliding-window layers' masks), q/k norms, a rotary embedding per kind.
    Family("gemma3_text", "Gemma 3", logits_softcap="final_logit_softcapping", rotary_per_layer_type=True,
           stored_prefixes=(("model.", "language_model.model."), ("model.", "model.language_model."),
                            ("lm_head.", "language_model.lm_head.")), text_of="gemma3"),
    # GLM-4 (dense): fused gate_up_proj like Phi-3, norms after attention and after the MLP too, partial rotary.
    Family("glm4", "GLM-4-9B, GLM-4-32B", lora_targets=ATTENTION + ("gate_up_proj", "down_proj")),
    # Gemma 1: embeddings scaled inside its embedding module, (1 + w) RMSNorms, GELU.
    Family("gemma", "Gemma 2B, 7B"),
    # SmolLM3: Llama-like, with some layers without rotary positions (config.no_rope_layers).
    Family("smollm3", "SmolLM3-3B"),
    # Mixture of experts: a router picks top-k experts per token; LoRA on attention (the experts are 3-D tensors).
    Family("qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B", lora_targets=ATTENTION, experts=Experts(
        "num_experts", "num_experts_per_tok", PER_EXPERT)),
    Family("mixtral", "Mixtral 8x7B, 8x22B", lora_targets=ATTENTION, experts=Experts(
        "num_local_experts", "num_experts_per_tok",
        stored=(("mlp.experts.gate_up_proj", ("block_sparse_moe.experts.{e}.w1.weight",
                                              "block_sparse_moe.experts.{e}.w3.weight")),
                ("mlp.experts.down_proj", ("block_sparse_moe.experts.{e}.w2.weight",))),
        renamed=(("mlp.gate.weight", "block_sparse_moe.gate.weight"),))),
    Family("olmoe", "OLMoE-1B-7B", lora_targets=ATTENTION, experts=Experts(
        "num_experts", "num_experts_per_tok", PER_EXPERT)),
    # Qwen1.5/2-MoE: routed experts plus a shared expert (a plain MLP, gated per token) in every layer.
    Family("qwen2_moe", "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B", lora_targets=ATTENTION, experts=Experts(
        "num_experts", "num_experts_per_tok", PER_EXPERT)),
    # GLM-4.5: the first first_k_dense_replace layers dense, then routed experts plus shared ones, a biased router.
    Family("glm4_moe", "GLM-4.5-Air, GLM-4.5", lora_targets=ATTENTION, experts=Experts(
        "n_routed_experts", "num_experts_per_tok", PER_EXPERT)),
    # DeepSeek-V2: multi-head latent attention (MLA) with a complex rotary on a slice of each head, the first
    # first_k_dense_replace layers dense, then routed experts (greedy or group-limited top-k) plus shared ones.
    Family("deepseek_v2", "DeepSeek-V2-Lite, DeepSeek-V2", lora_targets=MLA, rotary_complex=True,
           latent_q="q_lora_rank", experts=Experts(
        "n_routed_experts", "num_experts_per_tok", PER_EXPERT)),
    # DeepSeek-V3 (and Moonlight, Kimi K2): DeepSeek-V2's latent attention with a (cos, sin) rotary on interleaved
    # pairs, a sigmoid router with a loaded correction bias and group-limited top-k.
    Family("deepseek_v3", "Moonlight-16B-A3B, DeepSeek-V3, Kimi K2", lora_targets=MLA, latent_q="q_lora_rank",
           experts=Experts("n_routed_experts", "num_experts_per_tok", PER_EXPERT)),
    # Llama 4 (text): a complex rotary, layers without it (no_rope_layers), chunked attention, q/k L2 norms, routed
    # experts stored fused and transposed, each fed its input scaled by the router, plus a shared expert.
    Family("llama4_text", "Llama 4 Scout, Llama 4 Maverick (text)", lora_targets=ATTENTION, rotary_complex=True,
           stored_prefixes=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
           text_of="llama4", experts=Experts(
               "num_local_experts", "num_experts_per_tok", stored=(), module="feed_forward.experts",
               scaled_input=True, transposed=True),
           seq_limits=(SeqLimit("attention_chunk_size", 8192, "chunked attention"),  # transformers' defaults
                       SeqLimit("floor_scale", 8192, "query temperature", -1, switch="attn_temperature_tuning"))),
    # gpt-oss: attention sinks, sliding-window and full layers alternating, biased experts stored fused and
    # transposed ([E, H, 2I], gate and up interleaved) with a clamped SwiGLU, a biased router (softmax over its top-k).
    Family("gpt_oss", "gpt-oss-20b, gpt-oss-120b", lora_targets=ATTENTION, attention="eager", sinks=True,
           experts=Experts("num_local_experts", "num_experts_per_tok", stored=(), stored_format="MXFP4", gate_kept=6,
                           transposed=True)),
)}
MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
# Multimodal model_types whose config.json holds a family's text model as text_config.
TEXT_OF: dict[str, str] = {f.text_of: f.model_type for f in FAMILIES.values() if f.text_of}


def stored_names(fam: Family, name: str) -> list[str]:
    """The names a checkpoint may keep HF tensor ``name`` under besides its own (the family's stored_prefixes)."""
    return [stored + name[len(prefix):] for prefix, stored in fam.stored_prefixes if name.startswith(prefix)]


SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's attention kind, as transformers decides it: ``config.layer_types`` where the config has
    them; otherwise every layer slides when the config sets a sliding window (Mistral), else none does."""
    types = getattr(config, "layer_types", None)
    if types:
        return [str(t) for t in types]
    window = getattr(config, "sliding_window", None)
    return [SLIDING if window else FULL] * int(config.num_hidden_layers)


def attention_in_use(fam: Family, config: Any) -> str:
    """The attention implementation a configured HF config computes with (the runtime wraps it as hetero_<name>:
    runtime/stage/attention.py); the family's where the config was not configured."""
    name = getattr(config, "hetero_attention", None) or getattr(config, "_attn_implementation", None)
    return str(name).removeprefix("hetero_") if name else fam.attention_impl(config)


def needs_mask(fam: Family, config: Any, kind: str, seq_len: int) -> bool:
    """Whether a layer of ``kind`` gets an explicit mask tensor: always under eager attention; under SDPA only a
    sliding window shorter than the sequence (otherwise causal SDPA without a mask computes the same); never
    under flash-attn or flex attention, whose kernels take the causal shape and the window themselves."""
    impl = attention_in_use(fam, config)
    if impl in ("flash_attention_2", "flex_attention"):
        return False
    if impl != "sdpa":
        return True
    window = getattr(config, "sliding_window", None)
    return kind == SLIDING and window is not None and seq_len > int(window)


def check_seq_len(architecture: dict[str, Any], seq_len: int) -> None:
    """Refuse, in one line, a sequence longer than what the model's family computes as plain causal attention here
    (``Family.seq_limits``)."""
    fam = FAMILIES.get(str(architecture.get("model_type")))
    if fam is None or not fam.seq_limits:
        return
    limits = []
    for limit in fam.seq_limits:
        try:
            got = limit.of(architecture)
        except ValueError:
            keys = " and ".join(x.key for x in fam.seq_limits)
            raise ConfigError(f"model.architecture: {keys} of a {fam.model_type} model must be integers") from None
        if got is not None:
            limits.append(got)
    if limits and seq_len > min(limits):
        what = " and ".join(x.what for x in fam.seq_limits)
        raise ConfigError(f"model.seq_len={seq_len}: this {fam.model_type} model's {what} are computed as plain causal "
                          f"attention up to {min(limits)} tokens only; use model.seq_len<={min(limits)}")


def family(model_type: Any) -> Family:
    """The family of ``model_type``; UnsupportedModelError (one line) for any other."""
    found = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)} "
            "(docs/models.md lists them and how to add a family)")
    return found

