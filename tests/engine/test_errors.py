"""Errors that mean what they say: each bad input a typed PersistError that is also
the builtin it resembles, raised before anything is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, save_prompt_cache

import persist
from persist.errors import (
    InvalidArgumentError,
    InvalidStateError,
    PersistError,
    StorageError,
    UnknownKindError,
    UnsupportedCacheError,
    UnsupportedVersionError,
)
from tests.golden.cases import IDENTITY
from tests.helpers import prefill, tokens_for


def kv(dtype: Any, n: int = 3) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, n, 4), dtype=dtype), mx.zeros((1, 1, n, 4), dtype=dtype))
    return c


def test_a_dtype_the_format_lacks_is_refused_before_any_write(store: persist.Store) -> None:
    before = sorted(p.name for p in store.root.rglob("*") if p.is_file())
    with pytest.raises(UnsupportedCacheError, match="complex64") as e:
        store.save([kv(mx.complex64)], [1, 2, 3], identity=IDENTITY, session="c")
    assert isinstance(e.value, TypeError) and not store.has_session("c")
    assert sorted(p.name for p in store.root.rglob("*") if p.is_file()) == before
    with pytest.raises(UnsupportedCacheError):
        persist.save_file(store.root.parent / "c.safetensors", [kv(mx.complex64)], [1, 2, 3])
    assert not (store.root.parent / "c.safetensors").exists()


def test_a_cache_that_is_not_a_list_is_an_unsupported_cache(store: persist.Store) -> None:
    with pytest.raises(UnsupportedCacheError):
        store.save(kv(mx.float16), [1, 2, 3], identity=IDENTITY)  # type: ignore[arg-type]


def test_versions_are_not_unknown_kinds() -> None:
    e = UnsupportedVersionError("store-index", 9, 2)
    assert not isinstance(e, UnknownKindError) and isinstance(e, ValueError)
    assert "store-index" in str(e) and "upgrade persist" in str(e)


@pytest.mark.parametrize(
    "make",
    [
        lambda root: persist.Store(root, block_tokens=0),
        lambda root: persist.Store(root, max_bytes=-1),
        lambda root: persist.Store(root, namespace_max_bytes={"a": -5}),
    ],
)
def test_bad_store_options_are_invalid_arguments(tmp_path: Path, make: Any) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        make(tmp_path / "s")
    assert isinstance(e.value, ValueError)


def test_a_closed_store_says_so(tmp_path: Path) -> None:
    s = persist.Store(tmp_path / "s")
    s.close()
    s.close()  # twice is fine
    for call in (s.sessions, lambda: s.entry("x"), s.stats, lambda: s.gc()):
        with pytest.raises(InvalidStateError, match="closed"):
            call()


def test_a_store_the_system_refuses_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(StorageError) as e:
        persist.Store(tmp_path / "file" / "s")
    assert isinstance(e.value, OSError) and "file" in str(e.value)
    if os.geteuid() != 0:  # root ignores permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(StorageError):
            persist.Store(locked / "s")


def test_files_the_system_refuses_are_storage_errors(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        persist.save_file(tmp_path / "no" / "x.safetensors", [kv(mx.float16)], [1, 2, 3])
    with pytest.raises(StorageError):
        persist.load_file(tmp_path / "missing.safetensors")
    with pytest.raises(PersistError):
        persist.read_manifest(tmp_path)


def test_prefill_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgumentError):
        persist.prefill(object(), [1, 2], step=0)


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
            with pytest.raises(persist.NotResumableError, match=r"layer 0 \(kv\)"):
                save()
        assert store.sessions() == [] and store.stats().entries == 0


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
            with pytest.raises(persist.NotResumableError) as got:
                store.import_file(path, identity=who, tokens=toks, model=model, session="y")
            assert not isinstance(got.value, persist.CorruptBlobError), got.value
        assert store.sessions() == [] and store.stats().entries == 0
        assert not (tmp_path / "x.safetensors").exists()
