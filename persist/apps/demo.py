"""Tiny random-weight mlx-lm models with a real tokenizer, built offline.

``make_model(dir, arch)`` writes a model directory (config.json, safetensors
weights, tokenizer.json built with the ``tokenizers`` library) that
``mlx_lm.load(dir)`` loads with no network.  Deterministic for a given seed,
so two processes build the same model.  Used by the tests, the benchmarks
and ``persist make-model``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..storage.access import private_mkdir

__all__ = [
    "ARCHS",
    "make_model",
    "write_tokenizer",
    "SPECIAL_TOKENS",
    "demo_model_dir",
    "cache_home",
]

VOCAB = 260  # 256 byte tokens + 4 specials: every id the model emits decodes
MODEL_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **_ATTN,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "sliding_window": 32,
        "sliding_window_pattern": 3,
        "max_position_embeddings": 4096,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "num_experts_per_tok": 1,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [0, 1, 2, 3],
        "moe_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 4096,
        "full_attention_interval": 4,
        **_ATTN,
    },
    "mamba2": {
        "model_type": "mamba2",
        "num_heads": 4,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "state_size": 16,
        "num_hidden_layers": 2,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "expand": 1,
        "tie_word_embeddings": True,
        "time_step_limit": [0.0, 1e9],
        "time_step_rank": 4,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 32,
        "vocab_size": VOCAB,
        **_ATTN,
    },
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "attention_bias": False,
            "attention_chunk_size": 32,
            "hidden_size": 64,
            "interleave_moe_layer_step": 8,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "max_position_embeddings": 4096,
            "num_experts_per_tok": 1,
            "num_hidden_layers": 4,
            "num_local_experts": 2,
            "rms_norm_eps": 1e-5,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "use_qk_norm": True,
            "vocab_size": VOCAB,
            **_ATTN,
        },
    },
}

DTYPE_KEY = "_persist_dtype"  # an arch's own weight dtype; not written to config.json

# DeepSeek-V4 (mlx-lm's deepseek_v41): sliding window, compressed KV, index keys.
_DSV4: dict[str, Any] = {
    "model_type": "deepseek_v41",
    DTYPE_KEY: "float32",  # mlx's CPU GatherMM (its experts) needs float32
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 4],
    "kv_source_layer_ids": [1, 2],
    "index_source_layer_ids": [2],
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    "candidate_topk_blocks": 0,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 3,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}
ARCHS["deepseek_v4"] = _DSV4
# Without index layers: its forward is deterministic on the CPU (no top-k selection).
ARCHS["deepseek_v4_noindex"] = {**_DSV4, "index_source_layer_ids": []}


def write_tokenizer(directory: str | os.PathLike[str]) -> None:
    """A byte-level BPE tokenizer (256 byte tokens, no merges) plus chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    d = Path(directory)
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|eos|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _byte_of(ch: str) -> int:
    # ByteLevel maps bytes 0..255 to printable characters; order by byte value.
    from tokenizers.pre_tokenizers import ByteLevel

    table = getattr(_byte_of, "table", None)
    if table is None:
        chars = ByteLevel.alphabet()
        printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
        table = {chr(b): b for b in printable}
        n = 0
        for b in range(256):
            if b not in printable:
                table[chr(256 + n)] = b
                n += 1
        assert set(table) == set(chars)
        _byte_of.table = table  # type: ignore[attr-defined]
    return int(table[ch])


def make_model(
    directory: str | os.PathLike[str],
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random-weight model of ``arch`` into ``directory``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    if arch not in ARCHS:
        raise InvalidArgumentError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    config = json.loads(json.dumps(ARCHS[arch]))
    config.update(overrides or {})
    dtype = config.pop(DTYPE_KEY, dtype)
    d = Path(directory)
    private_mkdir(d)  # 0700 whatever the umask, and its missing parents too
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(d / "model.safetensors"), weights, metadata={"format": "mlx"})
    config["eos_token_id"] = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    (d / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(d)
    for name in MODEL_FILES:  # 0600 whatever the umask (mlx and tokenizers open with 0666)
        os.chmod(d / name, 0o600)
    return d


DEMO_ARCH = "llama"
DEMO_VERSION = 2


def cache_home() -> Path:
    """persist's own cache directory (the demo model, the default store):
    ``$PERSIST_HOME`` when set, so one folder holds all persist writes."""
    home = os.environ.get("PERSIST_HOME")
    if home:
        return Path(os.path.expandvars(os.path.expanduser(home)))
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("persist"))


def demo_model_dir() -> Path:
    """The built-in demo model, made once (deterministically) in the user cache dir."""
    import secrets

    target = cache_home() / f"demo-{DEMO_ARCH}-v{DEMO_VERSION}"
    if (target / "config.json").exists():
        return target
    private_mkdir(target.parent)  # persist's cache folder, the store's parent: 0700
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}"
    make_model(tmp, DEMO_ARCH, seed=0)
    try:
        os.rename(tmp, target)  # atomic; a concurrent maker may have won
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
