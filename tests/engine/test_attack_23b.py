"""Attacks on issue 23's fixes, round b (never a wrong cache): each is a strict xfail
that shows a failure found on main; the fix removes the marker."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

import persist
from tests.helpers import persist_cli, prefill, tokens_for


def _two_rows(cache: list[Any], n: int) -> list[Any]:
    """The same KV layers with the batch axis doubled (a file of a batch of 2)."""
    out = []
    for c in cache:
        k = KVCache()
        keys, values = c.keys[..., :n, :], c.values[..., :n, :]
        k.update_and_fetch(mx.concatenate([keys, keys]), mx.concatenate([values, values]))
        out.append(k)
    return out


def test_an_import_of_a_two_row_file_is_refused(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    cache, _ = prefill(model, toks)
    path = tmp_path / "b2.safetensors"
    save_prompt_cache(str(path), _two_rows(cache, 40))
    with persist.Store(tmp_path / "s") as store:
        try:
            store.import_file(path, identity=ident, tokens=toks, model=model, session="x")
        except persist.PersistError as e:
            assert isinstance(e, persist.NotResumableError), e
            assert "layer 0 (kv) holds a batch of 2 rows" in str(e) and str(path) in str(e)
            assert store.sessions() == []
            return
        hit = store.lookup([*toks, 7], identity=ident)  # another prompt sharing the tokens
        assert hit is not None
        fresh, _ = prefill(model, toks)
        assert [c.keys.shape[0] for c in hit.cache] == [c.keys.shape[0] for c in fresh]
        # what `persist generate --session x` does next: exit 3 with a ValueError
        model(mx.array([[7]]), cache=store.restore("x", identity=ident).cache)


def test_a_save_of_a_batch_of_two_is_refused_for_every_serial_kind(
    tiny: Any, tmp_path: Path
) -> None:
    """Store.save (and save_file with tokens) of two rows: plain KV, quantized KV,
    a CacheList around them, recurrent state (also with unverified tokens, and as
    an mlx-lm import with --unverified-tokens); a one-row batch cache still saves."""
    from mlx_lm.models.cache import BatchKVCache, CacheList

    model, tok, _ = tiny("llama_hd64")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    two = _two_rows(prefill(model, toks)[0], 40)
    q = [c.to_quantized(group_size=32, bits=4) for c in _two_rows(prefill(model, toks)[0], 40)]
    q_ident = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32)
    m_model, m_tok, _ = tiny("mamba2")
    m_ident = persist.ModelIdentity.of(m_model, m_tok)
    rec, _ = prefill(m_model, toks)
    for c in rec:
        c.cache = [mx.concatenate([a, a]) for a in c.cache]
    with persist.Store(tmp_path / "s") as store:
        for cache, who, kw in (
            (two, ident, {}),
            ([CacheList(c) for c in two], ident, {}),
            (q, q_ident, {}),
            (rec, m_ident, {}),
            (rec, m_ident, {"unverified_tokens": True}),
        ):
            with pytest.raises(persist.NotResumableError, match="holds a batch of 2 rows"):
                store.save(cache, toks, identity=who, session="b", **kw)
            with pytest.raises(persist.NotResumableError, match="holds a batch of 2 rows"):
                persist.save_file(tmp_path / "b.safetensors", cache, toks)
        path = tmp_path / "m2.safetensors"
        save_prompt_cache(str(path), rec)
        with pytest.raises(persist.NotResumableError, match=r"layer 0 \(arrays\) holds a batch"):
            store.import_file(path, identity=m_ident, tokens=toks, model=m_model,
                              session="m", unverified_tokens=True)  # fmt: skip
        assert store.sessions() == [] and store.stats().entries == 0
        one = []
        for c in prefill(model, toks)[0]:
            b = BatchKVCache(left_padding=[0])
            b.update_and_fetch(c.keys[..., :40, :], c.values[..., :40, :])
            one.append(b)
        store.save(one, toks, identity=ident, session="one")  # a batch of one: one sequence
        assert [e.session for e in store.sessions()] == ["one"]


def _disagreeing(cache: list[Any], keys: int, values: int, offset: int) -> list[Any]:
    bad = []
    for c in cache:
        k = KVCache()
        k.keys, k.values, k.offset = c.keys[..., :keys, :], c.values[..., :values, :], offset
        bad.append(k)
    return bad


def test_a_layer_whose_keys_and_values_disagree_is_refused_at_save(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    cache, _ = prefill(model, toks)
    bad = _disagreeing(cache, 40, 30, 40)
    path = tmp_path / "kv.safetensors"
    save_prompt_cache(str(path), bad)
    with persist.Store(tmp_path / "s") as store:
        for save in (
            lambda: store.import_file(path, identity=ident, tokens=toks, model=model, session="i"),
            lambda: store.save(bad, toks, identity=ident, session="l"),
        ):
            try:
                save()
            except persist.PersistError as e:
                assert not isinstance(e, persist.CorruptBlobError)
                assert isinstance(e, persist.NotResumableError) and "layer 0 (kv)" in str(e)
        for e in store.sessions():  # whatever was accepted must restore
            store.restore(e.session or "", identity=ident)
        assert store.sessions() == []


def test_every_inconsistent_attention_layer_is_refused_before_anything_is_written(
    tiny: Any, tmp_path: Path
) -> None:
    """Keys and values both shorter than the offset; other heads or batch in values;
    a rotating ring whose values are shorter than its keys; a quantized layer whose
    values hold fewer positions: each is refused at save, at save_file and at
    import, and the store holds nothing."""
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    model, tok, _ = tiny("llama_hd64")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    cache, _ = prefill(model, toks)
    short = _disagreeing(cache, 30, 30, 40)  # at least offset positions
    heads = _disagreeing(cache, 40, 40, 40)
    for c in heads:
        c.values = c.values[:, :1]
    ring = []
    for c in cache:
        r = RotatingKVCache(max_size=64)
        r.update_and_fetch(c.keys[..., :40, :], c.values[..., :40, :])
        r.values = r.values[..., :30, :]
        ring.append(r)
    quant = []
    for c in prefill(model, toks)[0]:
        qc = c.to_quantized(group_size=32, bits=4)
        assert isinstance(qc, QuantizedKVCache)
        qc.values = tuple(a[..., :30, :] for a in qc.values)
        quant.append(qc)
    q_ident = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32)
    with persist.Store(tmp_path / "s") as store:
        cases = [(short, ident, "kv"), (heads, ident, "kv"), (ring, ident, "rotating-kv")]
        for bad, who, kind in [*cases, (quant, q_ident, "quantized-kv")]:
            match = rf"layer 0 \({kind}\) is not a consistent cache"
            with pytest.raises(persist.NotResumableError, match=match):
                store.save(bad, toks, identity=who, session="x")
            with pytest.raises(persist.NotResumableError, match=match):
                persist.save_file(tmp_path / "x.safetensors", bad, toks)
            path = tmp_path / f"{kind}.safetensors"
            save_prompt_cache(str(path), bad)
            with pytest.raises(persist.PersistError) as got:
                store.import_file(path, identity=who, tokens=toks, model=model, session="y")
            assert not isinstance(got.value, persist.CorruptBlobError), got.value
        assert store.sessions() == [] and store.stats().entries == 0
        assert not (tmp_path / "x.safetensors").exists()


def test_a_weight_file_rewritten_in_place_is_not_the_remembered_model(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same size, same inode, mtime restored (rsync --inplace -t, a tool that keeps
    times, a filesystem with a coarse clock): the files changed, the key did not."""
    import shutil

    from persist.provenance import load_model

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    d = tmp_path / "m"
    shutil.copytree(model_dir("llama"), d)
    base = persist.ModelIdentity.from_path(d)  # remembered
    f = d / "model.safetensors"
    st = os.stat(f)
    with open(f, "r+b") as g:  # new values for the last 4 KiB of weights, in place
        g.seek(st.st_size - 4096)
        data = bytearray(g.read(4096))
        data[::2] = bytes(b ^ 0x40 for b in data[::2])
        g.seek(st.st_size - 4096)
        g.write(data)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    model, tok = load_model(d)[:2]
    hashed = persist.ModelIdentity.of(model, tok)
    assert hashed.digest != base.digest  # the weights did change
    assert persist.ModelIdentity.from_path(d).digest == hashed.digest


def test_a_rope_changed_in_memory_is_another_identity(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Context extension done in code after loading (a new nn.RoPE per layer): the
    model computes other logits, so the unmodified model's caches are wrong for it."""
    import mlx.nn as nn

    from persist.provenance import load_model

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    d = model_dir("llama")
    model, tok = load_model(d)[:2]
    remembered = persist.ModelIdentity.of(model, tok, path=d)
    hashed = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=1)
    _, before = prefill(model, toks)
    for layer in model.model.layers:
        r = layer.self_attn.rope
        layer.self_attn.rope = nn.RoPE(r.dims, traditional=r.traditional, base=r.base * 4)
    _, after = prefill(model, toks)
    assert not mx.array_equal(before, after).item()  # another model now
    assert persist.ModelIdentity.of(model, tok).digest != hashed.digest
    assert persist.ModelIdentity.of(model, tok, path=d).digest != remembered.digest


def _fake_hf_repo(hub: Path, repo: str, src: Path) -> None:
    """``repo`` in a Hugging Face cache at ``hub``, holding ``src``'s files."""
    import shutil

    root = hub / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / ("a" * 40)
    shutil.copytree(src, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("a" * 40)


def test_an_mlx_lm_export_for_a_repo_id_of_another_model_is_refused(
    tiny: Any, tmp_path: Path
) -> None:
    """`mlx_lm generate --prompt-cache-file OUT` without --model loads the file's
    `model`: here another llama, which would continue this llama's cache."""
    from persist.apps.demo import make_model

    d = tiny("llama")[2]
    other = tmp_path / "other"
    make_model(other, "llama", seed=1)
    hub = tmp_path / "hub"
    _fake_hf_repo(hub, "someone/other-llama", other)
    home = tmp_path / "home"
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    persist_cli(home, "generate", "--model", str(d), "--session", "s", "--prompt", "Hello",
                "--max-tokens", "2", env=env)  # fmt: skip
    out = tmp_path / "s.safetensors"
    got = persist_cli(home, "export", "s", str(out), "--format", "mlx-lm",
                      "--model", "someone/other-llama", check=False, env=env)  # fmt: skip
    assert got.returncode == 1 and not out.exists(), got.stdout + got.stderr
    assert "another model" in got.stderr
    _fake_hf_repo(hub, "someone/this-llama", d)  # the session's own model, by repo id
    ok = persist_cli(home, "export", "s", str(out), "--format", "mlx-lm",
                     "--model", "someone/this-llama", env=env)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    _, meta = load_prompt_cache(str(out), return_metadata=True)
    assert meta["model"] == "someone/this-llama"
    out.unlink()
    for model, says in (
        (str(tmp_path / "nowhere"), "no such folder"),  # a path that does not exist
        ("someone/not-cached", "not in the Hugging Face cache"),  # never downloaded
        (str(d / "config.json"), "not a folder"),
    ):
        got = persist_cli(home, "export", "s", str(out), "--format", "mlx-lm",
                          "--model", model, check=False, env=env)  # fmt: skip
        assert got.returncode == 1 and says in got.stderr, got.stderr
        assert not out.exists()
    with persist.Store(home) as store:  # the API cannot resolve a repo id: it must be told
        with pytest.raises(persist.ModelNotFoundError, match="not a folder"):
            store.export("s", out, format="mlx-lm", model="someone/this-llama")
        snap = hub / "models--someone--this-llama" / "snapshots" / ("a" * 40)
        store.export("s", out, format="mlx-lm", model="someone/this-llama", model_dir=snap)
        assert out.exists()


def test_a_cache_quantized_before_the_identitys_start_is_not_served(
    tiny: Any, tmp_path: Path
) -> None:
    """Under kv_bits=4, quantized_kv_start=500 a fresh run of 102 tokens is still plain
    KV; the hit hands out QuantizedKVCache layers (other logits from the first step)."""
    from tests.helpers import kv_quantized, live_state

    model, tok, _ = tiny("llama_hd64")
    toks = tokens_for(100, seed=2)
    early = kv_quantized(model, toks, 0, bits=4, group=32)
    late = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32, quantized_kv_start=500)
    with persist.Store(tmp_path / "s") as store:
        try:
            store.save(early, toks, identity=late, session="q")
        except persist.IdentityMismatchError:
            return
        hit = store.lookup([*toks, 1, 2], identity=late)
        assert hit is not None and len(hit.tokens) == 100
        fresh = kv_quantized(model, toks, 500, bits=4, group=32)  # plain KV at 100 tokens
        assert [persist.kind_of(c) for c in hit.cache] == [persist.kind_of(c) for c in fresh]
        assert live_state(hit.cache) == live_state(fresh)


def test_quantized_caches_and_the_identitys_start_at_every_door(tiny: Any, tmp_path: Path) -> None:
    """The early cache is refused at save (naming quantized_kv_start), as a captured
    snapshot, by checkpoint and as an mlx-lm import; mlx-lm itself quantizes a cache
    of exactly S positions (offset >= S): saved, restored by name, serving no prefix
    of S tokens, and its next turn (verified, not marked unverified) serves S + 1."""
    from persist.codecs.snapshot import capture
    from tests.helpers import assert_same_state, kv_quantized, live_state

    model, tok, _ = tiny("llama_hd64")
    toks = tokens_for(100, seed=2)
    early = kv_quantized(model, toks, 0, bits=4, group=32)
    q4 = {"kv_bits": 4, "kv_group_size": 32}
    late = persist.ModelIdentity.of(model, tok, **q4, quantized_kv_start=500)
    path = tmp_path / "early.safetensors"
    save_prompt_cache(str(path), early)
    with persist.Store(tmp_path / "s") as store:
        for save in (
            lambda: store.save(capture(early, toks), toks, identity=late, session="q"),
            lambda: store.checkpoint(early, toks, identity=late, session="q"),
            lambda: store.import_file(path, identity=late, tokens=toks, model=model, session="q"),
        ):
            with pytest.raises(persist.IdentityMismatchError, match="quantized_kv_start"):
                save()
        assert store.sessions() == [] and store.stats().entries == 0
        s = 64  # a file records no conversion point: quantized from 0 looks as from 64
        late = persist.ModelIdentity.of(model, tok, **q4, quantized_kv_start=s)
        at_start = kv_quantized(model, toks[:s], s, bits=4, group=32)
        assert {persist.kind_of(c) for c in at_start} == {"quantized-kv"}  # offset >= S
        entry = store.save(at_start, toks[:s], identity=late, session="q")
        assert entry.min_resume_offset == s + 1
        assert store.lookup([*toks[:s], 7], identity=late) is None
        got = store.restore("q", identity=late)
        assert_same_state(live_state(got.cache), live_state(at_start))
        more = toks[s : s + 8]
        model(mx.array([more]), cache=got.cache)
        turn = store.save(got.cache, toks[: s + 8], identity=late, session="q")
        assert "persist.unverified_tokens" not in turn.metadata
        hit = store.lookup([*toks[: s + 1], 7], identity=late)
        assert hit is not None and len(hit.tokens) == s + 1
        from persist.caches import DelayedQuantizedKVCache

        for start, ok in ((32, False), (s, True)):  # a delayed wrapper's conversion point
            wrapped = [DelayedQuantizedKVCache(start, bits=4, group_size=32) for _ in at_start]
            wrapped = persist.prefill(model, toks, cache=wrapped, step=128)
            assert all(c.converted_at == start for c in wrapped)
            if ok:
                store.save(wrapped, toks, identity=late, session=f"d{start}")
            else:
                with pytest.raises(persist.IdentityMismatchError, match="from 32 positions"):
                    store.save(wrapped, toks, identity=late, session=f"d{start}")
        loose = persist.ModelIdentity.of(model, tok, **q4)
        store.save(early, toks, identity=loose, session="e")  # names no start: no claim
