"""Plain records that travel between codecs, snapshots and files.

No mlx import here: a ``Record`` holds whatever array objects the codec put in
it, and a ``RecordSpec`` is what a file header promises before anything is
loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Progress = Callable[[int, int], None]  # (done, total): optional progress reporting

# The most tokens one snapshot or file may cover (4,194,304): above any context
# served today, and refused before a token list is unpacked.
MAX_TOKENS = 1 << 22

__all__ = [
    "MAX_TOKENS",
    "DTYPE_SIZES",
    "Progress",
    "TensorSpec",
    "Record",
    "RecordSpec",
    "ResumeFacts",
]

# safetensors dtype names persist accepts, and their item sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}

FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})
INT_DTYPES = frozenset({"I32", "I64", "U32", "I16", "U16", "I8", "U8"})


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype (safetensors name) and shape, known before loading."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)


@dataclass(frozen=True)
class RecordSpec:
    """What a stored record claims to be: checked by its codec before loading."""

    kind: str
    version: int
    meta: dict[str, Any]
    tensors: dict[str, TensorSpec]
    children: tuple[RecordSpec, ...] = ()


@dataclass(frozen=True)
class Record:
    """One encoded cache: kind, codec version, small meta, live tensors."""

    kind: str
    version: int
    meta: dict[str, Any]
    tensors: dict[str, Any] = field(default_factory=dict)
    children: tuple[Record, ...] = ()

    def spec(self, dtype_name: Any) -> RecordSpec:
        """The spec of this record; ``dtype_name`` maps an array to its dtype name."""
        return RecordSpec(
            kind=self.kind,
            version=self.version,
            meta=self.meta,
            tensors={k: TensorSpec(dtype_name(v), tuple(v.shape)) for k, v in self.tensors.items()},
            children=tuple(c.spec(dtype_name) for c in self.children),
        )


@dataclass(frozen=True)
class ResumeFacts:
    """What the resume policy needs to know about one layer's cache.

    ``offset`` is None for caches that do not track positions (mlx-lm's
    ArraysCache).  ``token_axes`` names the tensors that grow along the
    sequence and their axis; empty when the state cannot be cut by position.
    ``first_token`` is the position of the first token those tensors hold
    (non-zero for a chunked cache that dropped its front).
    """

    offset: int | None
    trimmable: bool
    min_resume_offset: int
    bytes_per_token: int
    token_axes: dict[str, int] = field(default_factory=dict)
    first_token: int = 0
