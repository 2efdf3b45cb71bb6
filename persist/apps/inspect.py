"""Library calls behind the CLI: each returns plain data for rendering.

The CLI parses, calls one of these, renders; nothing here knows about click.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..codecs.snapshot import snapshot_facts
from ..engine.files import load_file, read_manifest
from ..format.opening import user_reads
from ..records import RecordSpec

__all__ = ["LayerInfo", "FileInfo", "describe_file", "verify_file"]


@dataclass(frozen=True, kw_only=True)
class LayerInfo:
    index: int
    kind: str
    version: int
    tensors: int
    bytes: int
    offset: int | None = None
    trimmable: bool | None = None
    min_resume_offset: int | None = None


@dataclass(frozen=True)
class FileInfo:
    path: str
    file_bytes: int
    tensor_bytes: int
    tokens: int | None
    layers: list[LayerInfo]
    metadata: dict[str, str]
    identity: dict[str, Any] | None
    created: float
    verified: bool = False
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tensor_stats(spec: RecordSpec) -> tuple[int, int]:
    n, b = len(spec.tensors), sum(t.nbytes for t in spec.tensors.values())
    for c in spec.children:
        cn, cb = _tensor_stats(c)
        n, b = n + cn, b + cb
    return n, b


def describe_file(path: str | os.PathLike[str]) -> FileInfo:
    """What a persist file holds, from its validated header only (no tensor is read)."""
    m = read_manifest(path)
    with user_reads(str(path)):  # gone since it was read: StorageError, as a read's
        size = os.stat(path).st_size
    layers = []
    for i, spec in enumerate(m.layers):
        n, b = _tensor_stats(spec)
        layers.append(LayerInfo(index=i, kind=spec.kind, version=spec.version, tensors=n, bytes=b))
    return FileInfo(
        path=str(path),
        file_bytes=size,
        tensor_bytes=sum(layer.bytes for layer in layers),
        tokens=None if m.tokens is None else len(m.tokens),
        layers=layers,
        metadata=m.metadata,
        identity=m.identity,
        created=m.created,
    )


def verify_file(path: str | os.PathLike[str]) -> FileInfo:
    """Load a file completely (every checksum verified) and report its resume facts."""
    info = describe_file(path)
    t0 = time.perf_counter()
    loaded = load_file(path)
    seconds = time.perf_counter() - t0
    facts = snapshot_facts(loaded.cache)
    layers = [
        LayerInfo(
            index=layer.index,
            kind=layer.kind,
            version=layer.version,
            tensors=layer.tensors,
            bytes=layer.bytes,
            offset=f.offset,
            trimmable=f.trimmable,
            min_resume_offset=f.min_resume_offset,
        )
        for layer, f in zip(info.layers, facts, strict=True)
    ]
    return FileInfo(**{**info.__dict__, "layers": layers, "verified": True, "seconds": seconds})
