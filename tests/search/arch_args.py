"""The tiny arguments every mlx-lm architecture is built with (tests/search/architectures.py).

``GENERIC`` sets common field names wherever a ModelArgs has them,
``OVERRIDES`` what a module reads that no generic value fits (layer
patterns, nested configs, sizes that must divide), ``TEXT_ARGS`` the text
model a multimodal wrapper's ``text_config`` is filled for, and ``SKIPPED``
every module not searched, with the reason.
"""

from __future__ import annotations

from typing import Any

from persist.apps.demo import ARCHS

# Small sizes for fields many ModelArgs share; a window of 16 and chunks of 16
# so sessions of a few dozen tokens wrap rings and drop chunk fronts.
GENERIC: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "sliding_window": 16,
    "sliding_window_pattern": 2,
    "attention_chunk_size": 16,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    "num_nextn_predict_layers": 0,
    # other spellings of the same sizes (gpt2-like, phixtral, dbrx, afm7, ...)
    "n_embd": 64,
    "n_head": 4,
    "n_layer": 2,
    "n_positions": 4096,
    "n_ctx": 4096,
    "n_inner": 128,
    "rotary_dim": 8,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "hidden_dim": 64,
    "model_dim": 64,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "num_vocab": 256,
}

_ARGS = dict(ARCHS)  # persist's demo models: known-good tiny configs


def _demo(arch: str, **more: Any) -> dict[str, Any]:
    return {**{k: v for k, v in _ARGS[arch].items() if not k.startswith("_")}, **more}


# module -> fields set after the generic fill (where a model reads fields no
# generic value fits: layer patterns, nested configs, sizes that must divide)
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
_SW = ["sliding_attention", "full_attention"]
_CONV = ["conv", "full_attention"]
_LFM_BLOCK = {
    "block_dim": 64,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
}
OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_next": _demo("qwen3_next", full_attention_interval=2, num_hidden_layers=2),
    "mamba2": _demo("mamba2"),
    "falcon_h1": _demo("falcon_h1"),
    "gemma3_text": _demo(
        "gemma3", sliding_window=16, sliding_window_pattern=2, num_hidden_layers=2
    ),
    "gemma3n": {
        "layer_types": _SW,
        "num_kv_shared_layers": 0,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
        "activation_sparsity_pattern": [0.0, 0.0],
        "altup_num_inputs": 2,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_active_idx": 0,
        "laurel_rank": 8,
        "final_logit_softcapping": 30.0,
        "rope_local_base_freq": 10000.0,
    },
    "llama4": _demo("llama4"),
    "afm7": {"num_layers": 3, "num_kv_reuse_layers": 1},
    "afmoe": {"layer_types": _SW, "num_dense_layers": 1},
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "deepseek_v2": {"rope_scaling": {"factor": 1.0, "type": "yarn"}},
    "exaone4": {"sliding_window_pattern": "LG"},
    "exaone_moe": {"layer_types": _SW, "is_moe_layer": [False, True]},
    "gear": {"layer_types": _SW},
    "gemma4_text": {
        "num_hidden_layers": 4,
        "layer_types": _SW * 2,
        "num_kv_shared_layers": 2,
        "global_head_dim": 32,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 16,
    },
    "glm_moe_dsa": {"rope_parameters": _ROPE},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "shared_intermediate_size": 64,
    },
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 1,
    },
    "kimi_linear": {
        "linear_attn_config": {"kda_layers": [1], "num_heads": 4, "head_dim": 16},
        "num_experts": 4,
    },
    "kimi_k3": {
        "linear_attn_config": {
            "kda_layers": [1],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        }
    },
    "lfm2": {"layer_types": _CONV, "conv_L_cache": 3, **_LFM_BLOCK},
    "lfm2_moe": {"layer_types": _CONV, "conv_L_cache": 3, "num_dense_layers": 1},
    "longcat_flash": {
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "zero_expert_type": "identity",
        "zero_expert_num": 1,
    },
    "llama4_text": {"no_rope_layers": [1, 0]},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "mellum": {"layer_types": _SW, "rope_parameters": {k: _ROPE for k in _SW}},
    "muse_spark": {
        "layer_types": _SW,
        "layer_rope_theta": [10000.0, 10000.0],
        "mlp_layer_types": ["sparse", "sparse"],
        "num_shared_experts": 0,
        "rope_parameters": _ROPE,
        "moe_hidden_size": 32,
        "post_norm_eps": 1e-5,
        "final_logit_softcapping": 30.0,
        "output_multiplier": 1.0,
    },
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [1, 0],
        "moe_layer_freq": [0, 1],
        "sliding_window_size": 16,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
        "swa_rope_theta": 10000.0,
        "partial_rotary_factor": 1,
        "layernorm_epsilon": 1e-5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    },
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 4096}},
    "ministral3": {
        "rope_parameters": {
            **_ROPE,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096,
        }
    },
    "mistral4": {
        "rope_parameters": {
            **_ROPE,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096,
        }
    },
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        ]
    },
    "nemotron_h": {
        "hybrid_override_pattern": ["M", "*", "-"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
    },
    "olmo3": {"layer_types": _SW},
    "openelm": {
        "num_transformer_layers": 2,
        "num_query_heads": [4, 4],
        "num_kv_heads": [2, 2],
        "ffn_multipliers": [2.0, 2.0],
        "ffn_dim_divisor": 8,
    },
    # its logits mask ids 100256..100351 in place: a smaller vocabulary writes past them
    "phi3small": {"vocab_size": 100352},
    "plamo": {"n_shared_head": 2},
    "qwen": {"kv_channels": 16},
    "qwen3_5": {**_demo("qwen3_next"), "full_attention_interval": 2},
    "recurrent_gemma": {
        "block_types": ["recurrent", "attention"],
        "attention_window_size": 16,
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
    },
    "spark2_5": {"layer_types": _SW, "rope_parameters": {k: _ROPE for k in _SW}},
    "step3p5": {"moe_top_k": 2},
}

# wrapper -> its text model's args ("module.Class"), filled the same way into text_config
TEXT_ARGS: dict[str, str] = {
    "gemma3": "gemma3_text.ModelArgs",
    "kimi_k3": "kimi_k3.TextArgs",
    "gemma4": "gemma4_text.ModelArgs",
    "gemma3n": "gemma3n.TextConfig",
    "kimi_k25": "deepseek_v3.ModelArgs",
    "kimi_vl": "kimi_vl.TextArgs",
    "lfm2-vl": "lfm2.ModelArgs",
    "minimax_m3_vl": "minimax_m3_vl.TextArgs",
    "mistral3": "ministral3.ModelArgs",
    "pixtral": "llama.ModelArgs",
    "qwen2_vl": "qwen2.ModelArgs",
    "qwen3_vl": "qwen3.ModelArgs",
    "qwen3_vl_moe": "qwen3_moe.ModelArgs",
    "qwen3_5": "qwen3_5.TextModelArgs",
    "qwen3_5_moe": "qwen3_5.TextModelArgs",
    "muse_spark": "muse_spark.TextArgs",
}

_HELPER = "not an architecture: layers or utilities the models share (no Model class)"

# module -> why it is not searched.  A module mlx-lm adds that is in neither this
# dict nor the searched list (every other module) fails
# test_every_module_is_searched_or_skipped.
SKIPPED: dict[str, str] = {
    "activations": _HELPER,
    "base": _HELPER,
    "bitlinear_layers": _HELPER,
    "cache": _HELPER + " (the cache classes: every one is searched through the models)",
    "gated_delta": _HELPER,
    "mla": _HELPER,
    "pipeline": _HELPER,
    "rope_utils": _HELPER,
    "ssm": _HELPER,
    "switch_layers": _HELPER,
    "bitnet": "its BitLinear layers run only as a Metal kernel (no CPU back-end in MLX 0.32)",
    "muse_spark": "its fused qk-norm + RoPE runs only as a Metal kernel (no CPU back-end)",
    "olmo": "imports the ai2-olmo package, which mlx-lm does not install (the import exits)",
    "prism_hadamard_qwen35": (
        "a 2-bit Hadamard-rotated weight pack: its ModelArgs refuses any config but a packed "
        "checkpoint's (schema, namespace, quantization), so no random-weight model exists"
    ),
}
