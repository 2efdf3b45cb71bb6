"""Fail closed: unknown kinds, newer codecs, corrupt, truncated and hostile files.

Every refusal is a typed PersistError raised before any tensor is loaded,
never a crash and never a wrong cache.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgpack
import pytest
from mlx_lm.models import cache as mc

import persist
import persist.engine.files
import persist.engine.loading
from persist.errors import CorruptBlobError, UnknownKindError, UnsupportedVersionError
from tests.forge import edit_manifest, join, manifest_of, split, with_manifest


class MyKV(mc.KVCache):
    pass


class OtherKV(mc.KVCache):
    pass


def kv_cache(n: int = 12) -> mc.KVCache:
    c = mc.KVCache()
    k = mx.random.normal((1, 2, n, 8), key=mx.random.key(n))
    c.update_and_fetch(k, k + 1)
    return c


@pytest.fixture
def good(tmp_path: Path) -> Path:
    falcon_like = mc.CacheList(mc.ArraysCache(2), kv_cache())
    falcon_like.caches[0][0] = mx.ones((1, 3, 4))
    p = tmp_path / "good.safetensors"
    persist.save_file(p, [kv_cache(), falcon_like], list(range(12)))
    return p


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any tensor is loaded (refusals must come first)."""

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("a tensor was allocated before the file was refused")

    monkeypatch.setattr(persist.engine.files, "allocate", boom)  # every tensor read path
    monkeypatch.setattr(persist.engine.loading, "allocate_many", boom)


def test_unregistered_subclass_is_refused_at_save(tmp_path: Path) -> None:
    c = MyKV()
    c.update_and_fetch(*(mx.zeros((1, 1, 2, 4)),) * 2)
    with pytest.raises(UnknownKindError, match="MyKV"):
        persist.save_file(tmp_path / "x.safetensors", [c])
    assert list(tmp_path.iterdir()) == []


def test_registered_subclass_round_trips_as_itself(tmp_path: Path) -> None:
    persist.register_kind(OtherKV, "other-kv", persist.codec_for("kv"))
    c = OtherKV()
    c.update_and_fetch(*(mx.ones((1, 1, 3, 4)),) * 2)
    assert persist.kind_of(c) == "other-kv"
    persist.save_file(tmp_path / "x.safetensors", [c])
    (r,) = persist.load_file(tmp_path / "x.safetensors").cache
    assert type(r) is OtherKV and r.offset == 3
    with pytest.raises(ValueError):
        persist.register_kind(mc.KVCache, "other-kv", persist.codec_for("kv"))


@pytest.mark.parametrize(
    "layer,path,kind",
    [
        (0, (), "zeta-kv"),  # unknown leaf
        (1, (), "cache-list(arrays,zeta-kv)"),  # unknown inner kind of a wrapper
        (1, (1,), "zeta-kv"),  # inner record's own kind unknown
        (0, (), "kv(arrays)"),  # a leaf used as a wrapper
        (0, (), "Kv"),  # malformed
        (0, (), "cache-list"),  # a wrapper without inner kinds
    ],
)
def test_unknown_kind_refused_before_any_tensor(
    good: Path, tmp_path: Path, no_load: None, layer: int, path: tuple[int, ...], kind: str
) -> None:
    def edit(m: dict[str, Any]) -> None:
        rec = m["layers"][layer]
        for j in path:
            rec = rec["children"][j]
        rec["kind"] = kind

    bad = edit_manifest(good, tmp_path / "bad.safetensors", edit)
    with pytest.raises(UnknownKindError):  # a malformed kind is a kind persist does not know
        persist.load_file(bad)


def test_newer_codec_version_refused(good: Path, tmp_path: Path, no_load: None) -> None:
    bad = edit_manifest(
        good, tmp_path / "v.safetensors", lambda m: m["layers"][0].__setitem__("version", 2)
    )
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        persist.load_file(bad)


def test_newer_file_format_refused(good: Path, tmp_path: Path, no_load: None) -> None:
    header, body = split(good)
    header["__metadata__"]["format_version"] = "2"
    (tmp_path / "f.safetensors").write_bytes(join(header, body))
    with pytest.raises(UnsupportedVersionError):
        persist.load_file(tmp_path / "f.safetensors")


@pytest.mark.parametrize("where", [0, 1, 100, -1])
def test_flipped_byte_in_tensor_data(good: Path, tmp_path: Path, where: int) -> None:
    header, body = split(good)
    b = bytearray(body)
    b[where] ^= 0x10
    (tmp_path / "flip.safetensors").write_bytes(join(header, bytes(b)))
    with pytest.raises(CorruptBlobError, match="checksum mismatch"):
        persist.load_file(tmp_path / "flip.safetensors")


def test_flipped_byte_anywhere_is_refused_or_harmless(good: Path, tmp_path: Path) -> None:
    """Every single-byte flip in the header is refused (or lands in padding)."""
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    original = persist.load_file(good)
    for pos in range(0, 8 + n, 7):
        b = bytearray(data)
        b[pos] ^= 0x01
        p = tmp_path / "h.safetensors"
        p.write_bytes(bytes(b))
        try:
            loaded = persist.load_file(p)
        except persist.PersistError:
            continue
        assert loaded.tokens == original.tokens  # only padding spaces may change


@pytest.mark.parametrize("cut", [0, 4, 8, 20, 200, -1, -100])
def test_truncated_file(good: Path, tmp_path: Path, cut: int, no_load: None) -> None:
    data = good.read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:cut])
    with pytest.raises(CorruptBlobError):
        persist.load_file(tmp_path / "t.safetensors")


def hostile_headers(good: Path) -> list[bytes]:
    header, body = split(good)
    key = next(k for k in header if k != "__metadata__")
    out = [struct.pack("<Q", 1 << 62) + b"{}", struct.pack("<Q", 10) + b"not json!!"]
    for change in (
        {"dtype": "F128"},
        {"shape": [1 << 39, 1 << 39]},
        {"shape": [-1]},
        {"data_offsets": [0, 1 << 50]},
        {"data_offsets": [8, 4]},
        {"dtype": "F16" if header[key]["dtype"] != "F16" else "BF16"},  # dtype lie, same size
    ):
        h = {**header, key: {**header[key], **change}}
        out.append(join(h, body))
    # two tensors pointing at the same bytes
    keys = [k for k in header if k != "__metadata__"]
    h = {**header, keys[1]: {**header[keys[1]], "data_offsets": header[keys[0]]["data_offsets"]}}
    out.append(join(h, body))
    out.append(join({**header, "__metadata__": {"format": "persist"}}, body))
    out.append(join({k: v for k, v in header.items() if k != "__metadata__"}, body))
    return out


def test_hostile_safetensors_headers(good: Path, tmp_path: Path, no_load: None) -> None:
    for i, blob in enumerate(hostile_headers(good)):
        p = tmp_path / f"h{i}.safetensors"
        p.write_bytes(blob)
        with pytest.raises(persist.PersistError):
            persist.load_file(p)


def test_hostile_msgpack(good: Path, tmp_path: Path, no_load: None) -> None:
    header, body = split(good)
    bombs = [
        b"\xdd\xff\xff\xff\xff",  # array of 4 billion items, no items
        b"\xdf\xff\xff\xff\xff",  # map of 4 billion entries
        b"\xc6\xff\xff\xff\xf0",  # bin of 4 GB
        b"\xdb\xff\xff\xff\xf0abc",  # str of 4 GB
        b"\x91" * 100000 + b"\xc0",  # 100k nested arrays
        b"\xc1",  # never-used byte
    ]
    m = manifest_of(header)
    m2 = dict(m, n_tokens=1 << 27)  # token count lie
    m3 = dict(
        m,
        layers=[
            {"kind": "kv", "version": 1, "meta": {"offset": 1 << 40}, "tensors": [], "children": []}
        ],
    )
    forged = [msgpack.packb(x, use_bin_type=True) for x in (m2, m3, [1, 2], "kv")]
    for i, raw in enumerate(bombs + forged):
        h = {k: dict(v) if isinstance(v, dict) else v for k, v in header.items()}
        with_manifest(h, None, raw=raw)
        p = tmp_path / f"m{i}.safetensors"
        p.write_bytes(join(h, body))
        with pytest.raises(persist.PersistError):
            persist.load_file(p)


def test_meta_inconsistent_with_tensors(good: Path, tmp_path: Path, no_load: None) -> None:
    cases = [
        lambda m: m["layers"][0]["meta"].__setitem__("offset", 11),
        lambda m: m["layers"][0]["meta"].__setitem__("offset", "12"),
        lambda m: m["layers"][0]["meta"].__setitem__("offset", -1),
        lambda m: m["layers"][1]["children"][0]["meta"].__setitem__("present", [True]),
        lambda m: m["layers"][1]["meta"].__setitem__("n", 3),
        lambda m: m["layers"][0]["tensors"].pop(),
        lambda m: m.__setitem__("tokens", m["tokens"][:-4]),
    ]
    for i, edit in enumerate(cases):
        with pytest.raises(persist.PersistError):
            persist.load_file(edit_manifest(good, tmp_path / f"c{i}.safetensors", edit))


def test_tokens_must_match_the_cache(good: Path, tmp_path: Path) -> None:
    def shorter(m: dict[str, Any]) -> None:
        m["n_tokens"] = 11
        m["tokens"] = m["tokens"][:44]

    with pytest.raises(persist.NotResumableError):
        persist.load_file(edit_manifest(good, tmp_path / "t.safetensors", shorter))


def test_not_a_persist_file(tmp_path: Path) -> None:
    c = kv_cache()
    from mlx_lm.models.cache import save_prompt_cache

    save_prompt_cache(str(tmp_path / "mlx.safetensors"), [c])
    # a valid mlx-lm file is not damage: a typed refusal naming the import command
    with pytest.raises(persist.UnsupportedFormatError, match="not a persist file"):
        persist.load_file(tmp_path / "mlx.safetensors")
    junk = tmp_path / "other.safetensors"
    mx.save_safetensors(str(junk), {"x": mx.zeros((2,))}, {"a": "b"})
    with pytest.raises(CorruptBlobError, match="not a persist file"):
        persist.load_file(junk)
