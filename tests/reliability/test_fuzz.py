"""Hostile input: mutated persist files, blobs and imports give only typed errors.

Hypothesis mutates valid files (byte flips, truncations, insertions, header
and manifest rewrites with valid checksums).  Every outcome is either a
PersistError or, for a harmless mutation, the original cache.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mc

import persist
from persist.format.container import checksum
from tests.helpers import live_state
from tests.reliability.conftest import scale

EXAMPLES = int(os.environ.get("PERSIST_FUZZ_EXAMPLES", scale(300, 10_000)))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def sample_cache() -> list[Any]:
    kv = mc.KVCache()
    kv.update_and_fetch(*(mx.random.normal((1, 2, 9, 8), key=mx.random.key(1)),) * 2)
    ring = mc.RotatingKVCache(max_size=4, keep=1)
    ring.update_and_fetch(*(mx.random.normal((1, 2, 9, 8), key=mx.random.key(2)),) * 2)
    arrays = mc.CacheList(mc.ArraysCache(2), mc.KVCache())
    arrays.caches[0][0] = mx.ones((1, 3))
    arrays.caches[1].update_and_fetch(*(mx.zeros((1, 1, 9, 4)),) * 2)
    return [kv, ring, arrays]


@pytest.fixture(scope="module")
def original(tmp_path_factory: Any) -> tuple[bytes, dict[str, Any]]:
    path = tmp_path_factory.mktemp("fuzz") / "good.safetensors"
    ident = persist.ModelIdentity("fuzz", "c", "w", "t", "h", name="fuzz")
    persist.save_file(path, sample_cache(), list(range(9)), metadata={"k": "v"}, identity=ident)
    return path.read_bytes(), live_state(persist.load_file(path).cache)


def outcome(path: Path, want: dict[str, Any], tally: Any) -> None:
    try:
        loaded = persist.load_file(path)
    except persist.PersistError as e:
        tally.error("fuzz", e)
        return
    assert live_state(loaded.cache) == want, "a mutated file loaded as another cache"
    tally.error("fuzz", None)


mutations = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
        st.tuples(st.just("cut"), st.integers(0, 1 << 20), st.just(0)),
        st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.integers(0, 255)),
    ),
    min_size=1,
    max_size=4,
)


@SETTINGS
@given(muts=mutations)
def test_mutated_bytes(
    muts: list[tuple[str, int, int]], original: Any, tmp_path: Path, tally: Any
) -> None:
    data, want = original
    b = bytearray(data)
    for kind, pos, arg in muts:
        pos %= max(len(b), 1)
        if kind == "flip" and b:
            b[pos] ^= 1 << arg
        elif kind == "cut":
            del b[pos:]
        else:
            b.insert(pos, arg)
    p = tmp_path / "m.safetensors"
    p.write_bytes(bytes(b))
    tally.add("fuzz", cases=1)
    outcome(p, want, tally)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 62), 1 << 62) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@SETTINGS
@given(
    field=st.sampled_from(
        [
            "kind",
            "version",
            "meta",
            "tensors",
            "children",
            "n_tokens",
            "tokens",
            "layers",
            "identity",
            "metadata",
            "v",
        ]
    ),
    value=json_values,
    layer=st.integers(0, 2),
)
def test_forged_manifest_values(
    field: str, value: Any, layer: int, original: Any, tmp_path: Path, tally: Any
) -> None:
    """Manifest rewritten with a valid checksum: only its content is hostile."""
    data, want = original
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    m = msgpack.unpackb(base64.b64decode(header["__metadata__"]["manifest"]), raw=False)
    if field in ("kind", "version", "meta", "tensors", "children"):
        m["layers"][layer][field] = value
    else:
        m[field] = value
    raw = msgpack.packb(m, use_bin_type=True)
    header["__metadata__"]["manifest"] = base64.b64encode(raw).decode()
    header["__metadata__"]["manifest_xxh3"] = checksum(raw).hex()
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    p = tmp_path / "f.safetensors"
    p.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    tally.add("fuzz", cases=1)
    outcome(p, want, tally)


@settings(
    max_examples=max(EXAMPLES // 10, 30),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(pos=st.integers(0, 1 << 20), bit=st.integers(0, 7), cut=st.booleans())
def test_damaged_import_and_blob_reader(
    pos: int, bit: int, cut: bool, original: Any, tmp_path: Path, tally: Any
) -> None:
    """``persist import`` of a damaged file, and a store blob damaged the same way."""
    data, want = original
    b = bytearray(data)
    pos %= len(b)
    if cut:
        del b[pos:]
    else:
        b[pos] ^= 1 << bit
    p = tmp_path / "i.safetensors"
    p.write_bytes(bytes(b))
    ident = persist.ModelIdentity("fuzz", "c", "w", "t", "h", name="fuzz")
    with persist.Store(tmp_path / "store") as store:
        try:
            store.import_file(p, session="x")
            r = store.restore("x", identity=ident)
            assert live_state(r.cache) == want
        except persist.PersistError as e:
            tally.error("fuzz", e)
        tally.add("fuzz", cases=1)
        for blob in (tmp_path / "store" / "blobs").rglob("*.safetensors"):
            raw = bytearray(blob.read_bytes())
            raw[pos % len(raw)] ^= 1 << bit
            blob.write_bytes(bytes(raw))
        try:
            if store.sessions():
                r = store.restore("x", identity=ident)
                assert live_state(r.cache) == want
        except persist.PersistError as e:
            tally.error("fuzz", e)
        store.check(fix=True)
        for s in store.sessions():
            store.delete(s.session or "")
