"""The manifest: what a persist file holds, as msgpack in the safetensors header.

It lists every layer's record (kind, codec version, meta, tensor names,
inner records), the tokens, user metadata, the model identity, and each
tensor's dtype, shape and checksum.  Parsing is bounded and strict: every
field is type-checked and cross-checked against the safetensors table
before a single tensor is read.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import (
    CorruptBlobError,
    InvalidMetadataError,
    UnsupportedFormatError,
    UnsupportedVersionError,
)
from ..records import MAX_TOKENS, Record, RecordSpec, TensorSpec
from .container import CHECKSUM_BYTES, Header, checksum
from .tokens import pack_tokens, unpack_tokens

__all__ = [
    "check_metadata",
    "FORMAT",
    "FORMAT_VERSION",
    "Manifest",
    "pack_manifest",
    "unpack_manifest",
    "tensor_keys",
    "file_metadata",
    "pack_snapshot_manifest",
    "snapshot_specs",
    "blob_metadata",
    "blob_manifest",
    "BLOB_FORMAT",
]

FORMAT = "persist"
FORMAT_VERSION = 1
MAX_LAYERS = 4096
MAX_META_ITEMS = 256
MAX_USER_METADATA = 1 << 20
# MAX_TOKENS token ids (16 MiB) plus layers, checksums and metadata.
MAX_MANIFEST_BYTES = 24 << 20


@dataclass(frozen=True)
class Manifest:
    layers: list[RecordSpec]
    keys: list[dict[str, str]]  # per record (depth-first): tensor name -> file key
    tokens: list[int] | None
    metadata: dict[str, str]
    identity: dict[str, Any] | None
    checksums: dict[str, bytes]
    specs: dict[str, TensorSpec]  # file key -> dtype and shape
    offsets: dict[str, int]  # file key -> absolute byte offset of its data
    created: float


def tensor_keys(records: list[Record]) -> Iterator[tuple[str, Record, str]]:
    """(file key, record, tensor name) for every tensor, depth first."""

    def walk(rec: Record, path: str) -> Iterator[tuple[str, Record, str]]:
        for name in rec.tensors:
            yield f"{path}/{name}", rec, name
        for j, child in enumerate(rec.children):
            yield from walk(child, f"{path}.{j}")

    for i, rec in enumerate(records):
        yield from walk(rec, str(i))


def _record_map(rec: Record) -> dict[str, Any]:
    return {
        "kind": rec.kind,
        "version": rec.version,
        "meta": rec.meta,
        "tensors": list(rec.tensors),
        "children": [_record_map(c) for c in rec.children],
    }


def pack_manifest(
    records: list[Record],
    specs: dict[str, TensorSpec],
    checksums: dict[str, bytes],
    *,
    tokens: list[int] | None,
    metadata: dict[str, str],
    identity: dict[str, Any] | None,
    created: float | None = None,
) -> bytes:
    body = {
        "v": FORMAT_VERSION,
        "layers": [_record_map(r) for r in records],
        "n_tokens": None if tokens is None else len(tokens),
        "tokens": None if tokens is None else pack_tokens(tokens),
        "metadata": metadata,
        "identity": identity,
        "tensors": {k: [s.dtype, list(s.shape), checksums[k]] for k, s in specs.items()},
        "created": time.time() if created is None else created,
    }
    return msgpack.packb(body, use_bin_type=True)


def file_metadata(manifest: bytes) -> dict[str, str]:
    """The safetensors ``__metadata__`` that carries a manifest."""
    return {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "manifest": base64.b64encode(manifest).decode("ascii"),
        "manifest_xxh3": checksum(manifest).hex(),
    }


def is_mlx_lm_metadata(meta: dict[str, str]) -> bool:
    """mlx-lm's save_prompt_cache flattens [metadata, class names, scalars]: keys "1.0", ..."""
    return meta.get("format") != FORMAT and "1.0" in meta and "2.0" in meta


def unpack_manifest(header: Header, where: str) -> Manifest:
    """Validate the header's manifest against the header's tensor table."""
    meta = header.metadata
    if is_mlx_lm_metadata(meta):
        raise UnsupportedFormatError(
            f"{where} is an mlx-lm prompt cache (save_prompt_cache), not a persist file; "
            f"store it with: persist import {where} --model MODEL --prompt TEXT"
        )
    if meta.get("format") != FORMAT:
        raise CorruptBlobError(where, "not a persist file (no persist manifest in its header)")
    version = meta.get("format_version", "")
    if not version.isdigit():
        raise CorruptBlobError(where, f"malformed format version {version!r}")
    if int(version) > FORMAT_VERSION:
        raise UnsupportedVersionError("persist-file", int(version), FORMAT_VERSION)
    encoded = meta.get("manifest", "")
    if len(encoded) > (MAX_MANIFEST_BYTES + 2) // 3 * 4:  # refused before decoding it
        raise CorruptBlobError(where, f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise CorruptBlobError(where, "manifest is not base64") from None
    if checksum(raw).hex() != meta.get("manifest_xxh3"):
        raise CorruptBlobError(where, "manifest checksum mismatch")
    try:
        body = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=len(raw),
            max_str_len=len(raw),
            max_array_len=len(raw),
            max_map_len=len(raw),
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types on hostile input
        raise CorruptBlobError(where, f"manifest is not valid msgpack: {e}") from None
    return _parse(body, header, where)


def _bad(where: str, what: str) -> CorruptBlobError:
    return CorruptBlobError(where, f"manifest: {what}")


def _parse(body: Any, header: Header, where: str) -> Manifest:
    if not isinstance(body, dict) or body.get("v") != FORMAT_VERSION:
        raise _bad(where, "not a version-1 manifest map")
    table = body.get("tensors")
    if not isinstance(table, dict) or set(table) != set(header.tensors):
        raise _bad(where, "tensor list does not match the file's tensors")
    sums: dict[str, bytes] = {}
    for key, row in table.items():
        if (
            not isinstance(row, list)
            or len(row) != 3
            or not isinstance(row[2], bytes)
            or len(row[2]) != CHECKSUM_BYTES
        ):
            raise _bad(where, f"malformed entry for tensor {key!r}")
        spec = header.tensors[key].spec
        if row[0] != spec.dtype or row[1] != list(spec.shape):
            raise _bad(
                where,
                f"tensor {key!r} is {spec.dtype}{list(spec.shape)} in the "
                f"header but {row[0]}{row[1]} in the manifest",
            )
        sums[key] = row[2]
    layers_raw = body.get("layers")
    if not isinstance(layers_raw, list) or len(layers_raw) > MAX_LAYERS:
        raise _bad(where, "malformed layer list")
    keys: list[dict[str, str]] = []
    layers = [_spec(r, str(i), header, keys, where, 0) for i, r in enumerate(layers_raw)]
    used = {k for m in keys for k in m.values()}
    if used != set(header.tensors):
        raise _bad(where, "records and tensors do not match one to one")
    return Manifest(
        layers=layers,
        keys=keys,
        tokens=_tokens(body, where),
        metadata=_user_metadata(body.get("metadata"), where),
        identity=_identity(body.get("identity"), where),
        checksums=sums,
        specs={k: e.spec for k, e in header.tensors.items()},
        offsets={k: e.start for k, e in header.tensors.items()},
        created=float(body["created"]) if isinstance(body.get("created"), (int, float)) else 0.0,
    )


def _spec(
    r: Any, path: str, header: Header, keys: list[dict[str, str]], where: str, depth: int
) -> RecordSpec:
    if depth > 8 or not isinstance(r, dict):
        raise _bad(where, f"record {path} is malformed")
    kind, version, meta, names, children = (
        r.get("kind"),
        r.get("version"),
        r.get("meta"),
        r.get("tensors"),
        r.get("children"),
    )
    if not isinstance(kind, str) or type(version) is not int:
        raise _bad(where, f"record {path} has no kind or version")
    if not isinstance(meta, dict) or len(meta) > MAX_META_ITEMS or not _plain(meta):
        raise _bad(where, f"record {path} has malformed meta")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _bad(where, f"record {path} has a malformed tensor list")
    if not isinstance(children, list):
        raise _bad(where, f"record {path} has a malformed child list")
    mapping = {n: f"{path}/{n}" for n in names}
    missing = [k for k in mapping.values() if k not in header.tensors]
    if missing:
        raise _bad(where, f"record {path} names missing tensors {missing[:3]}")
    keys.append(mapping)
    tensors = {n: header.tensors[k].spec for n, k in mapping.items()}
    kids = tuple(
        _spec(c, f"{path}.{j}", header, keys, where, depth + 1) for j, c in enumerate(children)
    )
    return RecordSpec(kind, version, meta, tensors, kids)


def _plain(v: Any, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return not isinstance(v, str) or len(v) <= 4096
    if depth > 3:
        return False
    if isinstance(v, list):
        return len(v) <= 4096 and all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return len(v) <= MAX_META_ITEMS and all(
            isinstance(k, str) and _plain(x, depth + 1) for k, x in v.items()
        )
    return False


def _tokens(body: dict[str, Any], where: str) -> list[int] | None:
    n, raw = body.get("n_tokens"), body.get("tokens")
    if n is None and raw is None:
        return None
    if type(n) is not int or not 0 <= n <= MAX_TOKENS or not isinstance(raw, bytes):
        raise _bad(where, f"malformed token list (at most {MAX_TOKENS} tokens)")
    if len(raw) != 4 * n:
        raise _bad(where, f"token list holds {len(raw)} bytes for {n} tokens")
    return unpack_tokens(raw)


def check_metadata(metadata: Any) -> dict[str, str]:
    """The caller's metadata: strings to strings (as mlx-lm's save_prompt_cache)."""
    try:
        meta = dict(metadata or {})
    except (TypeError, ValueError):
        raise InvalidMetadataError("metadata must map strings to strings") from None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidMetadataError("metadata must map strings to strings")
    if _metadata_size(meta) > MAX_USER_METADATA:
        raise InvalidMetadataError(
            f"metadata holds {_metadata_size(meta)} bytes; at most {MAX_USER_METADATA >> 20} MiB"
        )
    return meta


def _metadata_size(meta: dict[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in meta.items())


def _user_metadata(m: Any, where: str) -> dict[str, str]:
    if m is None:
        return {}
    if not isinstance(m, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in m.items()
    ):
        raise _bad(where, "metadata must map strings to strings")
    if _metadata_size(m) > MAX_USER_METADATA:
        raise _bad(where, f"metadata larger than {MAX_USER_METADATA >> 20} MiB")
    return m


def _identity(d: Any, where: str) -> dict[str, Any] | None:
    if d is None:
        return None
    if not isinstance(d, dict) or not _plain(d):
        raise _bad(where, "malformed identity")
    return d


# -- the snapshot manifest: the store index's ``manifest`` column ------------


def pack_snapshot_manifest(
    records: list[Record], specs: dict[str, TensorSpec], split: dict[str, int], block: int
) -> bytes:
    """Layers, whole-tensor specs, which tensors are cut into token blocks, the block size."""
    body = {
        "v": 1,
        "layers": [_record_map(r) for r in records],
        "tensors": {k: [s.dtype, list(s.shape)] for k, s in specs.items()},
        "split": split,
        "block": block,
    }
    return msgpack.packb(body, use_bin_type=True)


def snapshot_specs(body: dict[str, Any]) -> list[RecordSpec]:
    """Record specs (whole tensors) from a snapshot manifest; trusted index data."""
    tensors = {k: TensorSpec(v[0], tuple(v[1])) for k, v in body["tensors"].items()}

    def build(r: dict[str, Any], path: str) -> RecordSpec:
        ts = {n: tensors[f"{path}/{n}"] for n in r["tensors"]}
        kids = tuple(build(c, f"{path}.{j}") for j, c in enumerate(r["children"]))
        return RecordSpec(r["kind"], r["version"], r["meta"], ts, kids)

    return [build(r, str(i)) for i, r in enumerate(body["layers"])]


# -- the blob envelope: the store's blobs carry their checksums the same way --

BLOB_FORMAT = "persist-blob"


def blob_metadata(role: str, sums: dict[str, bytes]) -> dict[str, str]:
    body = msgpack.packb({"role": role, "tensors": sums}, use_bin_type=True)
    return {
        "format": BLOB_FORMAT,
        "format_version": "1",
        "manifest": base64.b64encode(body).decode("ascii"),
    }


def blob_manifest(header: Header, where: str) -> dict[str, bytes]:
    """Checksums per tensor from a blob's header (the header itself was verified)."""
    meta = header.metadata
    if meta.get("format") != BLOB_FORMAT or meta.get("format_version") != "1":
        raise CorruptBlobError(where, "not a persist blob")
    try:
        body = msgpack.unpackb(
            base64.b64decode(meta.get("manifest", ""), validate=True),
            raw=False,
            max_bin_len=1 << 24,
            max_str_len=1 << 20,
        )
        sums = body["tensors"]
        assert isinstance(sums, dict) and set(sums) == set(header.tensors)
        assert all(isinstance(v, bytes) and len(v) == CHECKSUM_BYTES for v in sums.values())
    except Exception:
        raise CorruptBlobError(where, "malformed blob manifest") from None
    return sums
