"""The safetensors container: a validating header reader and a streaming writer.

Pure Python, no mlx: the store uses it on blobs too.  The reader checks the
whole header against the file before anything is allocated (sizes, offsets,
dtypes, shapes); the writer streams one tensor at a time into a
``format.sink.Sink``, hashing as it writes, then fills the checksums into a
header of fixed length.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import xxhash

from ..errors import CorruptBlobError
from ..records import DTYPE_SIZES, TensorSpec
from .sink import Sink

__all__ = ["MAX_HEADER_BYTES", "Entry", "Header", "read_header", "header_bytes"]
__all__ += ["parse_header", "write_tensors", "checksum", "CHECKSUM_BYTES"]

MAX_HEADER_BYTES = 40 << 20  # the largest manifest (32 MiB as base64) and 65,536 tensor entries
MAX_TENSORS = 1 << 16  # 4,096 layers of up to 16 tensors
MAX_NDIM = 8
MAX_JSON_DEPTH = 8  # a safetensors header nests 3 deep; refuse more before parsing
_INNERMOST = re.compile(rb"[\[{][^\[\]{}]*[\]}]")
_NOT_STRUCTURE = bytes(set(range(256)) - set(b'"[]{}'))
CHECKSUM_BYTES = 16


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
    digest: bytes  # checksum of the header bytes (length prefix included)


def _check_nesting(text: bytes, where: str) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH, in linear time, without recursion.

    Escapes go first (then no quote is escaped), then everything but quotes
    and brackets, then strings; what is left is the bracket skeleton.
    """
    bare = text.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, delete=_NOT_STRUCTURE)
    bare = b"".join(bare.split(b'"')[::2])  # outside strings: every other piece
    for _ in range(MAX_JSON_DEPTH):
        bare, n = _INNERMOST.subn(b"", bare)
        if n == 0:
            break
    if any(c in bare for c in b"[]{}"):
        raise CorruptBlobError(where, f"header nests deeper than {MAX_JSON_DEPTH} levels")


def _looks_like_json(text: bytes, where: str) -> None:
    """Refuse, as "not JSON", a header that cannot be JSON (not UTF-8, brackets that do
    not pair up): checked before the depth, so that garbage is not reported as nesting
    too deep.  Linear, in C (no Python loop)."""
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptBlobError(where, "header is not JSON (not UTF-8 text)") from None
    bare = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    bare = b"".join(bare.split(b'"')[::2])  # outside strings
    if bare.count(b"{") != bare.count(b"}") or bare.count(b"[") != bare.count(b"]"):
        raise CorruptBlobError(where, "header is not JSON (unbalanced brackets)")


def read_header(f: BinaryIO, where: str, size: int | None = None) -> Header:
    """Read and validate a safetensors header; raise CorruptBlobError if anything is off.

    ``size`` is the file's size when ``f`` is not a file (bytes from a tier)."""
    size = os.fstat(f.fileno()).st_size if size is None else size
    return parse_header(header_bytes(f, where, size), size, where)


def header_bytes(f: BinaryIO, where: str, size: int) -> bytes:
    """The header's bytes, length prefix included, read from the start of ``f`` (a
    file of ``size`` bytes): bounded before they are read, not yet parsed."""
    raw = f.read(8)
    if len(raw) < 8:
        raise CorruptBlobError(where, f"file of {size} bytes is too short to be safetensors")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES:
        raise CorruptBlobError(where, f"header of {n} bytes is larger than {MAX_HEADER_BYTES}")
    if n > size - 8:
        raise CorruptBlobError(where, f"header length {n} exceeds the file ({size} bytes)")
    text = f.read(n)
    if len(text) != n:
        raise CorruptBlobError(where, "file truncated inside the header")
    return raw + text


def parse_header(head: bytes, size: int, where: str) -> Header:
    """Validate and parse ``header_bytes``' bytes of a file of ``size`` bytes."""
    text = memoryview(head)[8:].tobytes()
    # Counted before parsing: a header of a million empty tensors costs a
    # gigabyte of Python objects once parsed.
    if text.count(b'"data_offsets"') > MAX_TENSORS:
        raise CorruptBlobError(where, f"header lists more than {MAX_TENSORS} tensors")
    _looks_like_json(text, where)
    _check_nesting(text, where)
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
    data_start = len(head)
    entries = {k: _entry(where, k, v, data_start) for k, v in obj.items()}
    _check_layout(where, entries, data_start, size)
    return Header(entries, meta, data_start, size, checksum(head))


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


# A tensor's bytes, in one buffer or several contiguous ones in row-major order.
Producer = Callable[[], memoryview | Sequence[memoryview]]


def write_tensors(
    sink: Sink,
    tensors: Iterable[tuple[str, TensorSpec, Producer]],
    metadata: Callable[[dict[str, bytes]], dict[str, str]],
    checksums: dict[str, bytes] | None = None,
) -> dict[str, bytes]:
    """Stream tensors into ``sink`` as safetensors; return their checksums.

    Each producer is called once, right before its bytes are written, so at
    most one materialized tensor is alive at a time; it may hand back several
    buffers (a strided tensor's contiguous runs), written and hashed in order
    without a copy.  ``checksums`` the caller already computed are trusted
    (one pass over the bytes, not two).  ``metadata`` is called with
    placeholder checksums to size the header and again with the real ones;
    it must produce strings of the same length both times.  The real header
    is written before the sink's one fsync (``finish``); the caller renames
    the file after that, never writing to it again.
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
    head = _header_bytes(table, metadata(zero), sink.align)
    sink.write(head)
    sums: dict[str, bytes] = {}
    for name, spec, produce in items:
        data = produce()
        parts = [data] if isinstance(data, memoryview) else list(data)
        if sum(p.nbytes for p in parts) != spec.nbytes:
            raise ValueError(f"tensor {name!r}: wrong byte count, expected {spec.nbytes}")
        known = None if checksums is None else checksums.get(name)
        h = None if known is not None else xxhash.xxh3_128()
        for part in parts:
            if h is not None:
                h.update(part)
            sink.write(part)
        sums[name] = h.digest() if h is not None else bytes(known or b"")
        del data, parts
    sink.flush()
    final = _header_bytes(table, metadata(sums), sink.align)
    if len(final) != len(head):
        raise RuntimeError("header length changed between passes")  # a bug, not bad input
    # The real header goes in before the one fsync: after a power cut the disk
    # holds either no file under its final name or this whole file.
    sink.rewrite_head(final)
    sink.head_digest = checksum(final)
    sink.finish()
    return sums


def _header_bytes(table: dict[str, object], meta: dict[str, str], align: int) -> bytes:
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % align)  # data starts aligned
    return struct.pack("<Q", len(body)) + body
