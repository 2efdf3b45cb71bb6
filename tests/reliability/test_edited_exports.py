"""A persist export edited by hand (its identity or tokens replaced, its unkeyed
checksums recomputed) is not imported as the cache it claims to be: an import with
``--model`` checks the file's model against that model, and under the operator key
(``PERSIST_TIER_KEY``) an export carries a keyed tag over its manifest and tensor
bytes that an import verifies.  An outside attack relabelled model A's cache as model
B's and got it served to B (logits off by 5.8).  Real tiny models, real files, the
real CLI."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from mlx_lm.models.cache import make_prompt_cache

import persist
from persist.apps.demo import make_model
from tests.helpers import persist_cli, prefill, tokens_for

KEY = "ab" * 16
OTHER_KEY = "cd" * 16


def exported(
    model_dir: Any, tmp_path: Path, key: str | None = None, **cache_config: Any
) -> tuple[Path, list[int]]:
    """Session ``s`` of the tiny llama, exported by the CLI (under ``key`` if given)."""
    d = model_dir("llama")
    ident = persist.ModelIdentity.from_path(d, **cache_config)
    model, _ = persist.provenance.load_model(d)[:2]
    toks = tokens_for(40, seed=3)
    window = cache_config.get("max_kv_size")
    cache, _ = prefill(model, toks, cache=make_prompt_cache(model, max_kv_size=window))
    with persist.Store(tmp_path / "src") as store:
        store.save(cache, toks, identity=ident, session="s")
    out = tmp_path / "s.safetensors"
    env = {"PERSIST_TIER_KEY": key} if key else None
    persist_cli(tmp_path, "export", "s", str(out), "--store", str(tmp_path / "src"), env=env)
    return out, toks


def header(path: Path) -> tuple[dict[str, Any], bytes]:
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8 : 8 + n]), b[8 + n :]


def rewrite(
    src: Path, dst: Path, edit: Callable[[dict[str, Any]], None], data_edit: Any = None
) -> None:
    """As the attacker did: edit the manifest (and maybe the data), recompute every
    unkeyed checksum, keep the header's length."""
    h, data = header(src)
    meta = h["__metadata__"]
    man = msgpack.unpackb(base64.b64decode(meta["manifest"]), raw=False)
    if data_edit is not None:
        data = data_edit(h, man, bytearray(data))
    edit(man)
    raw = msgpack.packb(man, use_bin_type=True)
    meta["manifest"] = base64.b64encode(raw).decode()
    meta["manifest_xxh3"] = xxhash.xxh3_128(raw).hexdigest()
    hb = json.dumps(h).encode()
    hb += b" " * ((-(8 + len(hb))) % 8)
    dst.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(data))


def other_model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "b", "llama", seed=1)  # same config, other weights


def imported(tmp_path: Path, path: Path, *args: str, key: str | None = None) -> Any:
    env = {"PERSIST_TIER_KEY": key} if key else None
    store = str(tmp_path / "dst")
    return persist_cli(tmp_path, "import", str(path), "--store", store, *args, check=False, env=env)


def stored(tmp_path: Path) -> str:
    return persist_cli(tmp_path, "ls", "--all", "--json", "--store", str(tmp_path / "dst")).stdout


# -- (a) --model: the file's model must be that model ---------------------------------


def test_a_persist_file_imported_with_another_model_is_refused_naming_the_fields(
    model_dir: Any, tmp_path: Path
) -> None:
    path, _ = exported(model_dir, tmp_path)
    out = imported(tmp_path, path, "--model", str(other_model(tmp_path)))
    assert (out.returncode, "Traceback" in out.stderr) == (1, False), out.stderr
    assert "another model" in out.stderr and "weights" in out.stderr, out.stderr


def test_a_persist_file_of_a_windowed_session_imports_with_its_model(
    model_dir: Any, tmp_path: Path
) -> None:
    """The session's cache settings (max_kv_size here) are not the model's: --model
    checks the model, and the file's own settings are kept."""
    path, _ = exported(model_dir, tmp_path, max_kv_size=64)
    out = imported(tmp_path, path, "--model", str(model_dir("llama")))
    assert out.returncode == 0, out.stderr


# -- (b) the operator key: a keyed tag over the manifest and the tensor bytes ---------


def test_an_export_under_the_key_imports_under_the_key(model_dir: Any, tmp_path: Path) -> None:
    path, _ = exported(model_dir, tmp_path, key=KEY)
    out = imported(tmp_path, path, "--session", "copy", key=KEY)
    assert out.returncode == 0, out.stderr


def test_an_export_under_the_key_carries_its_tag(model_dir: Any, tmp_path: Path) -> None:
    path, _ = exported(model_dir, tmp_path, key=KEY)
    assert len(header(path)[0]["__metadata__"]["persist_tag"]) == 64


def test_an_export_without_the_key_is_laid_out_as_before(model_dir: Any, tmp_path: Path) -> None:
    path, _ = exported(model_dir, tmp_path)
    assert set(header(path)[0]["__metadata__"]) == {
        "format", "format_version", "manifest", "manifest_xxh3",
    }  # fmt: skip


def test_an_edited_identity_under_the_key_is_refused(model_dir: Any, tmp_path: Path) -> None:
    path, _ = exported(model_dir, tmp_path, key=KEY)
    theirs = persist.ModelIdentity.from_path(other_model(tmp_path)).to_dict()
    forged = tmp_path / "forged.safetensors"
    rewrite(path, forged, lambda m: m.__setitem__("identity", theirs))
    out = imported(tmp_path, forged, key=KEY)
    assert (out.returncode, "Traceback" in out.stderr) == (1, False), out.stderr
    assert "operator key" in out.stderr and stored(tmp_path).strip() == "[]", out.stderr


def test_edited_tokens_under_the_key_are_refused_by_the_library(
    model_dir: Any, tmp_path: Path
) -> None:
    path, toks = exported(model_dir, tmp_path, key=KEY)
    forged = tmp_path / "forged.safetensors"
    other = struct.pack(f"<{len(toks)}I", *[(t + 7) % 250 for t in toks])
    rewrite(path, forged, lambda m: m.__setitem__("tokens", other))
    store = persist.Store(tmp_path / "dst", tier_key=bytes.fromhex(KEY))
    with store, pytest.raises(persist.UnauthenticatedFileError, match="tag"):
        store.import_file(forged)


def test_edited_tensor_bytes_under_the_key_are_refused(model_dir: Any, tmp_path: Path) -> None:
    """Tensor checksums are xxh3 (unkeyed, recomputable): the tag covers the bytes."""
    path, _ = exported(model_dir, tmp_path, key=KEY)

    def flip(h: dict[str, Any], man: dict[str, Any], data: bytearray) -> bytearray:
        start, end = h["0/keys"]["data_offsets"]
        data[start] ^= 0x40
        man["tensors"]["0/keys"][2] = xxhash.xxh3_128_digest(bytes(data[start:end]))
        return data

    forged = tmp_path / "forged.safetensors"
    rewrite(path, forged, lambda m: None, data_edit=flip)
    out = imported(tmp_path, forged, key=KEY)
    assert (out.returncode, "operator key" in out.stderr) == (1, True), out.stderr


def test_an_untagged_file_under_the_key_is_refused(model_dir: Any, tmp_path: Path) -> None:
    path, _ = exported(model_dir, tmp_path)  # no key: no tag (or a persist before round 5)
    out = imported(tmp_path, path, key=KEY)
    assert (out.returncode, "no tag" in out.stderr) == (1, True), out.stderr


def test_a_file_tagged_under_another_key_is_refused(model_dir: Any, tmp_path: Path) -> None:
    path, _ = exported(model_dir, tmp_path, key=OTHER_KEY)
    out = imported(tmp_path, path, key=KEY)
    assert (out.returncode, "operator key" in out.stderr) == (1, True), out.stderr


def test_an_untagged_file_imports_without_a_key(model_dir: Any, tmp_path: Path) -> None:
    """Files from before the tag (and from machines without a key) still import."""
    path, toks = exported(model_dir, tmp_path)
    with persist.Store(tmp_path / "dst") as store:
        assert store.import_file(path).tokens == len(toks)
