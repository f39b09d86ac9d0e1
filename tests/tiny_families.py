"""Support for the tests (data, not tests): a tiny random-init config of every family but llama, the same sizes
with what makes each family itself."""

from __future__ import annotations

COMMON = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0}


# The tiny config of each family: the same sizes, and what makes the family itself (values of its real configs).
TINY = {
    # A sliding window shorter than the sequence: every Mistral layer attends to the last 16 positions only.
    "mistral": {"model_type": "mistral", "head_dim": 16, "sliding_window": 16},
    "qwen2": {"model_type": "qwen2", "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "olmo2": {"model_type": "olmo2"},
    "phi3": {"model_type": "phi3", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "granite": {"model_type": "granite", "embedding_multiplier": 12.0, "logits_scaling": 8.0,
                "residual_multiplier": 0.22, "attention_multiplier": 0.0625},
    # A sliding window shorter than the sequence, so that the sliding layers' masks matter.
    "gemma2": {"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh"},
    # Both layer kinds in every stage: each its own rotary base frequency (10^4 sliding, 10^6 global) and mask.
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention"] * 3,
                    "hidden_activation": "gelu_pytorch_tanh"},
    # Mixtures of experts: top-2 routing, so that each token's output mixes two experts' weights.
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                  "num_experts_per_tok": 2, "norm_topk_prob": True},
    "mixtral": {"model_type": "mixtral", "head_dim": 16, "intermediate_size": 48, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "glm4": {"model_type": "glm4", "head_dim": 16, "partial_rotary_factor": 0.5},
    "gemma": {"model_type": "gemma", "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"},
    # Every other layer without rotary positions, as SmolLM3-3B's config has them (1: rotary, 0: none).
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 0] * 3},
    "olmoe": {"model_type": "olmoe", "intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"model_type": "qwen2_moe", "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                  "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
    # Attention sinks, sliding and full layers alternating (a window shorter than the records), biased experts with
    # the clamped SwiGLU, a biased router.
    "gpt_oss": {"model_type": "gpt_oss", "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 3},
    # The first layer dense, then routed and shared experts (the real models keep 1-3 layers dense).
    "glm4_moe": {"model_type": "glm4_moe", "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
                 "topk_group": 1},
    # MLA: q through a latent (DeepSeek-V2; V2-Lite has q_lora_rank null), a shared k/v latent, a rotary slice of 8;
    # one dense layer, then 8 routed experts (top-2) and a shared one.
    "deepseek_v2": {"model_type": "deepseek_v2", "q_lora_rank": 24, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 16, "v_head_dim": 16, "num_key_value_heads": 4, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1},
    # V2's latent attention with V3's router (sigmoid scores, a correction bias, 2 groups of which the best 1 is
    # searched) and interleaved rotary pairs; q straight through q_proj here (Moonlight's q_lora_rank is null).
    "deepseek_v3": {"model_type": "deepseek_v3", "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 16, "v_head_dim": 16, "num_key_value_heads": 4, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
    # Scout's layout: every layer routed (4 experts, top-1, input scaled by the router) plus a shared expert, every
    # 4th layer without rotary, chunked and full layers, q/k L2 norms.
    "llama4_text": {"model_type": "llama4_text", "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 64,
                    "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                    "attention_chunk_size": 128, "floor_scale": 128, "use_qk_norm": True,
                    "no_rope_layers": [1, 1, 1, 0, 1, 1],
                    "layer_types": ["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 2},
}


# A clip bound below each family's gradient norm, so that the global clip acts (granite's scaled logits give norms
# near 1e-3 on the tiny model).
CLIP = {"granite": 0.001}
