"""ModelIdentity: equal for the same model and cache config, different otherwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import persist
from persist import IdentityMismatchError, ModelIdentity
from persist.apps.demo import make_model


def test_from_path_equals_of_loaded_model(tiny: Any) -> None:
    model, tok, d = tiny("llama")
    a = ModelIdentity.from_path(d)
    b = ModelIdentity.of(model, tok)
    assert a == b and a.digest == b.digest and hash(a) == hash(b)
    assert a.name == "llama" and dict(a.versions)["mlx-lm"]


def test_other_weights_config_tokenizer_or_cache_config_differ(tiny: Any, tmp_path: Path) -> None:
    model, tok, d = tiny("llama")
    base = ModelIdentity.of(model, tok)
    other = make_model(tmp_path / "seed1", "llama", seed=1)
    assert ModelIdentity.from_path(other).diff(base) == ["weights"]
    rope = make_model(tmp_path / "rope", "llama", overrides={"rope_theta": 500000.0})
    assert "config" in ModelIdentity.from_path(rope).diff(base)
    cfg = json.loads((Path(d) / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages }}"
    (rope / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert "chat_template" in ModelIdentity.from_path(rope).diff(base)
    q = ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=64, quantized_kv_start=0)
    assert q.diff(base) == [
        "cache_config.kv_bits",
        "cache_config.kv_group_size",
        "cache_config.quantized_kv_start",
    ]
    # quantization settings mean nothing without kv_bits
    assert ModelIdentity.of(model, tok, kv_group_size=32) == base
    with pytest.raises(TypeError, match="unknown cache configuration"):
        ModelIdentity.of(model, tok, kv_bitz=4)


def test_to_dict_round_trip_and_tamper(tiny: Any) -> None:
    model, tok, _ = tiny("llama")
    ident = ModelIdentity.of(model, tok, max_kv_size=128)
    assert ModelIdentity.from_dict(ident.to_dict()) == ident
    d = ident.to_dict()
    d["weights"] = "0" * 32
    with pytest.raises(ValueError, match="digest"):
        ModelIdentity.from_dict(d)


def test_load_file_refuses_another_model(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = ModelIdentity.of(model, tok)
    cache = make_prompt_cache(model)
    ids = tok.encode("a short conversation")
    model(mx.array([ids]), cache=cache)
    path = tmp_path / "s.safetensors"
    persist.save_file(path, cache, ids, identity=ident)
    loaded = persist.load_file(path, identity=ident)
    assert loaded.identity == ident
    other = ModelIdentity.of(model, tok, kv_bits=8)
    with pytest.raises(IdentityMismatchError, match=r"cache_config\.kv_bits") as e:
        persist.load_file(path, identity=other)
    assert e.value.fields == ["cache_config.kv_bits"]
