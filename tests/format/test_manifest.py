"""The manifests alone: a file's, the store's snapshot column, and the blob envelope."""

from __future__ import annotations

import msgpack
import pytest

from persist.errors import CorruptBlobError, InvalidMetadataError
from persist.format.container import CHECKSUM_BYTES, Entry, Header
from persist.format.manifest import (
    MAX_USER_METADATA,
    blob_manifest,
    blob_metadata,
    check_metadata,
    file_metadata,
    pack_manifest,
    pack_snapshot_manifest,
    snapshot_specs,
    unpack_manifest,
)
from persist.records import Record, TensorSpec

SPEC = TensorSpec("F16", (1, 2, 3, 4))
RECORD = Record("kv", 1, {"offset": 3}, {"keys": None, "values": None}, ())
SPECS = {"0/keys": SPEC, "0/values": SPEC}


def _header(meta: dict[str, str], tensors: dict[str, TensorSpec]) -> Header:
    entries, pos = {}, 0
    for k, s in tensors.items():
        entries[k] = Entry(s, pos, pos + s.nbytes)
        pos += s.nbytes
    return Header(entries, meta, 0, pos, b"")


def test_a_file_manifest_round_trips() -> None:
    sums = {k: bytes([i]) * CHECKSUM_BYTES for i, k in enumerate(SPECS)}
    body = pack_manifest(
        [RECORD], SPECS, sums, tokens=[5, 6, 7], metadata={"a": "b"}, identity=None, created=1.5
    )
    m = unpack_manifest(_header(file_metadata(body), SPECS), "f")
    assert m.tokens == [5, 6, 7] and m.metadata == {"a": "b"} and m.checksums == sums
    assert m.layers[0].kind == "kv"
    assert dict(m.layers[0].tensors) == {"keys": SPEC, "values": SPEC}
    assert m.keys == [{"keys": "0/keys", "values": "0/values"}]


def test_a_manifest_that_disagrees_with_the_header_is_refused() -> None:
    sums = {k: bytes(CHECKSUM_BYTES) for k in SPECS}
    body = pack_manifest(
        [RECORD], SPECS, sums, tokens=None, metadata={}, identity=None, created=0.0
    )
    other = {"0/keys": SPEC, "0/values": TensorSpec("F32", SPEC.shape)}
    with pytest.raises(CorruptBlobError):
        unpack_manifest(_header(file_metadata(body), other), "f")


def test_the_snapshot_manifest_round_trips() -> None:
    body = msgpack.unpackb(pack_snapshot_manifest([RECORD], SPECS, {"0/keys": 2}, 256))
    (spec,) = snapshot_specs(body)
    assert spec.kind == "kv" and spec.meta == {"offset": 3}
    assert dict(spec.tensors) == {"keys": SPEC, "values": SPEC}
    assert body["split"] == {"0/keys": 2} and body["block"] == 256


def test_the_blob_envelope_round_trips_and_refuses_others() -> None:
    sums = {"0/keys": b"\x01" * CHECKSUM_BYTES}
    header = _header(blob_metadata("block", sums), {"0/keys": SPEC})
    assert blob_manifest(header, "b") == sums
    with pytest.raises(CorruptBlobError, match="not a persist blob"):
        blob_manifest(_header({"format": "persist"}, {"0/keys": SPEC}), "b")
    with pytest.raises(CorruptBlobError, match="malformed"):
        blob_manifest(_header(blob_metadata("block", {}), {"0/keys": SPEC}), "b")


def test_user_metadata_is_strings_and_bounded() -> None:
    assert check_metadata({"a": "b"}) == {"a": "b"}
    with pytest.raises(InvalidMetadataError) as e:
        check_metadata({"a": 1})
    assert isinstance(e.value, TypeError)
    with pytest.raises(InvalidMetadataError, match="MiB"):
        check_metadata({"big": "x" * MAX_USER_METADATA})
