"""Forge persist files for fail-closed tests: valid framing, hostile content."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from persist.format.container import checksum


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header: dict[str, Any], body: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + body


def manifest_of(header: dict[str, Any]) -> dict[str, Any]:
    raw = base64.b64decode(header["__metadata__"]["manifest"])
    return msgpack.unpackb(raw, raw=False)


def with_manifest(header: dict[str, Any], manifest: Any, *, raw: bytes | None = None) -> None:
    """Store ``manifest`` in ``header`` with a valid checksum (so only content is hostile)."""
    packed = raw if raw is not None else msgpack.packb(manifest, use_bin_type=True)
    header["__metadata__"]["manifest"] = base64.b64encode(packed).decode()
    header["__metadata__"]["manifest_xxh3"] = checksum(packed).hex()


def edit_manifest(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    header, body = split(src)
    m = manifest_of(header)
    edit(m)
    with_manifest(header, m)
    dst.write_bytes(join(header, body))
    return dst
