"""The safetensors container: a validating header reader and a streaming writer.

Pure Python, no mlx: the store uses it on blobs too.  The reader checks the
whole header against the file before anything is allocated (sizes, offsets,
dtypes, shapes); the writer streams one tensor at a time, hashing as it
writes, then fills the checksums into a header of fixed length.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO

import xxhash

from .errors import CorruptBlobError
from .records import DTYPE_SIZES, TensorSpec

__all__ = [
    "MAX_HEADER_BYTES",
    "Entry",
    "Header",
    "read_header",
    "write_tensors",
    "checksum",
    "fsync_dir",
    "CHECKSUM_BYTES",
]

MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 1 << 20
MAX_NDIM = 8
CHECKSUM_BYTES = 16
ALIGN = 8


def checksum(data: memoryview | bytes) -> bytes:
    """xxh3-128 of ``data``: tens of GB/s, so verifying every read is cheap."""
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True)
class Entry:
    spec: TensorSpec
    start: int  # absolute file offsets
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(f: BinaryIO, where: str) -> Header:
    """Read and validate a safetensors header; raise CorruptBlobError if anything is off."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) < 8:
        raise CorruptBlobError(where, f"file of {size} bytes is too short to be safetensors")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise CorruptBlobError(where, f"header length {n} exceeds the file ({size} bytes)")
    text = f.read(n)
    if len(text) != n:
        raise CorruptBlobError(where, "file truncated inside the header")
    try:
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptBlobError(where, f"header is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CorruptBlobError(where, "header is not a JSON object")
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptBlobError(where, "header metadata must map strings to strings")
    if len(obj) > MAX_TENSORS:
        raise CorruptBlobError(where, f"header lists {len(obj)} tensors")
    data_start = 8 + n
    entries = {k: _entry(where, k, v, data_start) for k, v in obj.items()}
    _check_layout(where, entries, data_start, size)
    return Header(entries, meta, data_start, size)


def _entry(where: str, name: str, v: object, base: int) -> Entry:
    if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
        raise CorruptBlobError(where, f"tensor {name!r}: malformed header entry")
    dtype, shape, offs = v["dtype"], v["shape"], v["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise CorruptBlobError(where, f"tensor {name!r}: unsupported dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
    ):
        raise CorruptBlobError(where, f"tensor {name!r}: malformed shape {shape!r}")
    if not (
        isinstance(offs, list)
        and len(offs) == 2
        and all(type(o) is int and o >= 0 for o in offs)
        and offs[0] <= offs[1]
    ):
        raise CorruptBlobError(where, f"tensor {name!r}: malformed data_offsets {offs!r}")
    spec = TensorSpec(dtype, tuple(shape))
    if offs[1] - offs[0] != DTYPE_SIZES[dtype] * math.prod(shape):
        raise CorruptBlobError(
            where, f"tensor {name!r}: {offs[1] - offs[0]} bytes for {dtype}{list(shape)}"
        )
    return Entry(spec, base + offs[0], base + offs[1])


def _check_layout(where: str, entries: dict[str, Entry], data_start: int, size: int) -> None:
    # Tensors must tile the data section exactly: no overlap, no gap, no tail.
    pos = data_start
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start != pos:
            raise CorruptBlobError(where, f"tensor data overlaps or leaves a gap at byte {pos}")
        pos = e.end
    if pos != size:
        raise CorruptBlobError(
            where, f"data section ends at byte {pos} but the file has {size} bytes"
        )


Producer = Callable[[], memoryview]


def write_tensors(
    f: BinaryIO,
    tensors: Iterable[tuple[str, TensorSpec, Producer]],
    metadata: Callable[[dict[str, bytes]], dict[str, str]],
) -> dict[str, bytes]:
    """Stream tensors into ``f`` as safetensors; return their checksums.

    Each producer is called once, right before its bytes are written, so at
    most one materialized tensor is alive at a time.  ``metadata`` is called
    with placeholder checksums to size the header and again with the real
    ones; it must produce strings of the same length both times.
    """
    items = list(tensors)
    zero = {name: bytes(CHECKSUM_BYTES) for name, _, _ in items}
    table: dict[str, object] = {}
    pos = 0
    for name, spec, _ in items:
        table[name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [pos, pos + spec.nbytes],
        }
        pos += spec.nbytes
    head = _header_bytes(table, metadata(zero))
    f.write(head)
    sums: dict[str, bytes] = {}
    for name, spec, produce in items:
        data = produce()
        if data.nbytes != spec.nbytes:
            raise ValueError(f"tensor {name!r}: {data.nbytes} bytes, expected {spec.nbytes}")
        sums[name] = checksum(data)
        f.write(data)
        del data
    final = _header_bytes(table, metadata(sums))
    if len(final) != len(head):
        raise RuntimeError("header length changed between passes")  # a bug, not bad input
    f.seek(0)
    f.write(final)
    f.seek(0, os.SEEK_END)
    return sums


def _header_bytes(table: dict[str, object], meta: dict[str, str]) -> bytes:
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % ALIGN)  # data starts 8-byte aligned
    return struct.pack("<Q", len(body)) + body


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
