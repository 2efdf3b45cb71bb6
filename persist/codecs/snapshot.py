"""A whole model's cache list plus the tokens it covers <-> encoded records.

The rules enforced here, before anything is written:

- a snapshot's tokens must be exactly what every layer covers: a cache keyed
  to other tokens would corrupt every later hit;
- with tokens, every layer holds one row (the batch axis, the first axis of
  every record's tensors, is 1): the tokens are one sequence, and a batch of
  two restored into a serial model crashes or answers for two;
- every record passes its codec's ``check``, the very check a restore runs,
  so nothing is stored that cannot be restored (a KV layer whose keys and
  values hold other lengths than its offset, or other batch/heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .. import policy
from ..cuda import readback
from ..errors import CorruptBlobError, NotResumableError, UnsupportedCacheError
from ..format.manifest import tensor_keys
from ..format.tensors import device_copy, on_cuda
from ..format.tokens import check_tokens
from ..kinds import is_batched, kind_of
from ..marks import carries_unverified
from ..records import Record, ResumeFacts
from ..yielding import pause
from . import check_spec, decode_record, encode_cache, facts_of
from .base import dtype_name

__all__ = [
    "Snapshot",
    "capture",
    "rebuild",
    "extract_row",
    "snapshot_facts",
    "require_covers",
    "require_one_row",
    "check_records",
]


@dataclass(frozen=True)
class Snapshot:
    records: list[Record]
    facts: list[ResumeFacts]
    tokens: list[int] | None
    # tensor key ("3/keys") -> its bytes as a zero-copy numpy view (host_bytes)
    host: dict[str, Any] = field(default_factory=dict)
    # captured from a cache that continues unverified tokens (``persist.marks``)
    unverified: bool = False

    @property
    def offset(self) -> int | None:
        return common_offset(self.facts)

    @property
    def trimmable(self) -> bool:
        return policy.combine_trimmable(f.trimmable for f in self.facts)

    @property
    def min_resume_offset(self) -> int:
        return policy.combine_floor(f.min_resume_offset for f in self.facts)


def common_offset(facts: Sequence[ResumeFacts]) -> int | None:
    return policy.common_offset(f.offset for f in facts)


def _as_list(cache: Any) -> list[Any]:
    if not isinstance(cache, (list, tuple)):
        raise UnsupportedCacheError("expected a model's cache: a list with one cache per layer")
    return list(cache)


def capture(cache: Any, tokens: Sequence[int] | None = None) -> Snapshot:
    """Encode every layer; refuse a cache that does not match ``tokens``."""
    layers = _as_list(cache)
    kinds = [kind_of(c) for c in layers]
    facts = [facts_of(c) for c in layers]
    toks = None if tokens is None else check_tokens(tokens)
    if toks is not None:
        _require_covers(kinds, facts, toks)
    else:
        common_offset(facts)
    records = [encode_cache(c) for c in layers]
    check_records(kinds, records)
    if toks is not None:
        require_one_row(kinds, records)
    # Evaluated here, in the caller's thread and stream; what follows (cutting
    # blocks, checksums, writes) reads host bytes and runs no MLX op: an MLX op
    # on an array another thread computed waits for everything queued on that
    # thread's stream (a whole prefill, in a server).  bfloat16, which numpy
    # cannot read, is seen through a uint16 view of the same memory.
    tensors = {key: rec.tensors[name] for key, rec, name in tensor_keys(records)}
    twins = {k: t.view(mx.uint16) if t.dtype == mx.bfloat16 else t for k, t in tensors.items()}
    if on_cuda():
        pause()  # persist serve's write-behind: a request that prompts goes first
        # A host read moves an MLX CUDA buffer into managed memory, and then every
        # decode step of the process slows (12 ms -> 1.8 s at 128k tokens on an
        # H200): the host reads through the driver (cuda/readback), row by row where
        # the arrays lie on the direct path, else from a device copy, so no buffer
        # ever turns managed.
        if readback.copies_first():
            twins = {k: device_copy(t) for k, t in twins.items()}
    mx.eval([*tensors.values(), *twins.values()])
    copied = readback.host_copies(list(twins.values())) if on_cuda() else None
    if copied is not None:
        host = {
            k: b.reshape(*t.shape, t.dtype.size)
            for (k, t), b in zip(twins.items(), copied, strict=True)
        }
    else:
        host = {k: host_bytes(t) for k, t in twins.items()}
    return Snapshot(records, facts, toks, host, carries_unverified(layers))


def host_bytes(a: Any) -> Any:
    """An evaluated array's bytes as a numpy uint8 view shaped ``(*shape, itemsize)``.

    Zero-copy, strides kept (a KV cache's live slice of a larger buffer is
    not copied): pieces are cut from it one block at a time.
    """
    if a.size == 0:
        return np.zeros((*a.shape, a.dtype.size), dtype=np.uint8)
    return np.asarray(memoryview(a))[..., None].view(np.uint8)


def require_covers(cache: Any, tokens: Sequence[int]) -> None:
    """Refuse a cache whose layers do not cover exactly ``tokens``."""
    layers = _as_list(cache)
    _require_covers([kind_of(c) for c in layers], [facts_of(c) for c in layers], tokens)


def _require_covers(kinds: list[str], facts: list[ResumeFacts], tokens: Sequence[int]) -> None:
    for i, k in enumerate(kinds):
        if is_batched(k) and facts[i].offset is None:
            raise NotResumableError(
                f"layer {i} ({k}) is a batch of several rows; choose one with "
                "persist.extract_row(cache, row) before saving it with tokens"
            )
    offset = common_offset(facts)
    if offset is not None and offset != len(tokens):
        raise NotResumableError(
            f"the cache covers {offset} positions but {len(tokens)} tokens were given"
        )


def check_records(kinds: Sequence[str], records: Sequence[Record]) -> None:
    """Every record through its codec's ``check`` (what a restore checks first): a
    live cache that fails it is refused now, not found unreadable later."""
    for i, (kind, rec) in enumerate(zip(kinds, records, strict=True)):
        try:
            check_spec(rec.spec(dtype_name))
        except CorruptBlobError as e:
            raise NotResumableError(
                f"layer {i} ({kind}) is not a consistent cache, so it cannot be saved: {e.detail}"
            ) from None


def record_rows(record: Record) -> set[int]:
    """The batch sizes a record's tensors (and its inner records') hold: the first
    axis of every tensor, for every built-in kind (a registered kind's too)."""
    rows = {int(t.shape[0]) for t in record.tensors.values() if getattr(t, "ndim", 0) >= 1}
    for child in record.children:
        rows |= record_rows(child)
    return rows


def require_one_row(kinds: Sequence[str], records: Sequence[Record], where: str = "") -> None:
    """Refuse any layer whose batch axis is not 1: a snapshot covers one token list."""
    for i, (kind, rec) in enumerate(zip(kinds, records, strict=True)):
        rows = record_rows(rec) - {1}
        if rows:
            head = f"{where}: " if where else ""
            raise NotResumableError(
                f"{head}layer {i} ({kind}) holds a batch of {max(rows)} rows: a snapshot covers "
                "one token sequence, so each row is saved as its own cache "
                "(persist.extract_row for mlx-lm's batch caches)"
            )


def snapshot_facts(cache: Any) -> list[ResumeFacts]:
    return [facts_of(c) for c in _as_list(cache)]


def rebuild(records: Sequence[Record]) -> list[Any]:
    """Live caches from checked records, evaluated so nothing stays lazy."""
    out = []
    for r in records:
        c = decode_record(r)
        mx.eval(_arrays(c))
        out.append(c)
    return out


def _arrays(c: Any) -> list[Any]:
    found: list[Any] = []
    stack = [c.state]
    while stack:
        x = stack.pop()
        if isinstance(x, mx.array):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return found


def extract_row(cache: Any, row: int) -> list[Any]:
    """One row of a batched cache list as serial caches (mlx-lm's ``extract``).

    The row gets its own offset, its left padding removed and its ring
    de-rolled, so it saves and resumes like a single-sequence cache.
    """
    out = []
    for c in _as_list(cache):
        if not hasattr(c, "extract"):
            raise NotResumableError(f"{kind_of(c)} cannot extract a row")
        out.append(c.extract(row))
    return out
