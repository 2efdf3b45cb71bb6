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


def test_two_loads_of_every_family_digest_their_modules_alike(tiny: Any, tmp_path: Path) -> None:
    """The modules component holds no object id, address or varying repr: a second
    load (eager, lazy through from_path, and in another process) gives the same."""
    import subprocess
    import sys

    from mlx_lm import load

    from tests.conftest import VARIANTS
    from tests.helpers import pythonpath

    for variant in VARIANTS:
        model, tok, d = tiny(variant)
        first = ModelIdentity.of(model, tok)
        assert first.modules and len(first.modules) == 32
        again = ModelIdentity.of(*load(str(d)))
        assert again.modules == first.modules, variant
        assert ModelIdentity.from_path(d) == first, variant
    model, tok, _ = tiny("qwen3_next")
    before = ModelIdentity.of(model, tok)
    from persist.caches.gated_delta import make_cache

    make_cache(model)  # speculative rounds' recording layers: the same arithmetic
    layer = model.layers[0].linear_attn
    assert type(layer).__name__.startswith("Recording")
    assert ModelIdentity.of(model, tok) == before
    recording = type(layer)
    try:  # a subclass of it that computes otherwise is another model
        layer.__class__ = type("Mine", (recording,), {"__call__": recording.__call__})
        assert ModelIdentity.of(model, tok).diff(before) == ["modules"]
    finally:
        layer.__class__ = recording
    d = tiny("llama")[2]
    code = f"import persist; print(persist.ModelIdentity.from_path({str(d)!r}).modules)"
    env = {"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == ModelIdentity.of(*tiny("llama")[:2]).modules, out.stderr


def test_what_a_module_computes_with_beside_its_weights_is_its_identity(
    tmp_path: Path,
) -> None:
    """An attention scale, a RoPE's frequencies (an array under a private name,
    which parameters() leaves out), a plain setting: each changed in memory
    changes the logits and the identity; the weights digest alone stays."""
    from persist.provenance import load_model
    from tests.helpers import prefill, tokens_for

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    d = make_model(tmp_path / "l3", "llama", overrides={"rope_scaling": scaling})
    toks = tokens_for(40, seed=2)
    edits = {
        "scale": lambda a: setattr(a, "scale", a.scale * 0.5),
        "_freqs": lambda a: setattr(a.rope, "_freqs", a.rope._freqs * 2),
        "traditional": lambda a: setattr(a.rope, "traditional", not a.rope.traditional),
    }
    for what, edit in edits.items():
        model, tok = load_model(d)[:2]
        assert hasattr(model.model.layers[0].self_attn.rope, "_freqs")
        base = ModelIdentity.of(model, tok, path=d)
        _, before = prefill(model, toks)
        for layer in model.model.layers:
            edit(layer.self_attn)
        _, after = prefill(model, toks)
        assert not mx.array_equal(before, after).item(), what
        for path in (d, None):
            now = ModelIdentity.of(model, tok, path=path)
            assert now.diff(base) == ["modules"], what


def test_an_identity_from_before_the_modules_field_loads_and_differs(tiny: Any) -> None:
    """An identity persist wrote before ``modules`` existed keeps its digest when read
    back, and never equals one made now: its caches are misses, not errors."""
    import dataclasses

    from persist.identity import DIGEST_FIELDS
    from persist.identity.model_facts import canonical, sha

    model, tok, _ = tiny("llama")
    now = ModelIdentity.of(model, tok)
    old = dataclasses.replace(now, modules="")
    d = old.to_dict()
    assert "modules" not in d and "modules" in now.to_dict()
    assert d["digest"] == sha(canonical({k: getattr(old, k) for k in DIGEST_FIELDS}))
    assert ModelIdentity.from_dict(d) == old and old != now
    assert now.diff(old) == ["modules"]
    assert ModelIdentity.from_dict(now.to_dict()) == now
