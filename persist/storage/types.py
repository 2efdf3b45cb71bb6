"""Plain result types of the store API.  No mlx."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EntryInfo", "Restored", "GcReport", "Problem", "StoreStats"]


@dataclass(frozen=True)
class EntryInfo:
    """One stored snapshot: a named session, a checkpoint, or an anonymous prefix."""

    id: int
    namespace: str
    session: str | None
    role: str  # "session" | "checkpoint" | "prefix"
    owner: str | None  # the session a checkpoint belongs to
    tokens: int
    bytes: int  # bytes of every blob it references (shared ones included)
    trimmable: bool
    min_resume_offset: int
    kinds: list[str]
    identity: str  # digest
    model: str  # the identity's name
    created: float
    used: float
    pinned: bool
    metadata: dict[str, str] = field(default_factory=dict)
    damaged: str | None = None  # a row whose fields do not decode: listed, never restored

    def __repr__(self) -> str:
        kinds = sorted(set(self.kinds))
        return (
            f"EntryInfo(id={self.id}, session={self.session!r}, namespace={self.namespace!r}, "
            f"role={self.role!r}, tokens={self.tokens}, bytes={self.bytes}, "
            f"layers={len(self.kinds)} ({', '.join(kinds)}), model={self.model!r}, "
            f"pinned={self.pinned})"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Restored:
    """A restored cache (fresh objects), the tokens it covers, and its entry.

    ``source``: where the bytes came from: ``"local"``, the store's files (a
    pull from a shared tier lands there first), or ``"host"``, the RAM copy
    of ``Store(host_cache=...)``, whose ``entry`` is the save's as it was then."""

    cache: list[Any]
    tokens: list[int]
    entry: EntryInfo
    notice: str | None = None  # said once: what a repair (check --fix) cut from this session
    source: str = "local"

    def __repr__(self) -> str:  # never hundreds of token ids
        return (
            f"Restored({len(self.tokens)} tokens {_ids(self.tokens)}, "
            f"{len(self.cache)} layers, from {self.source}, entry={self.entry!r})"
        )


@dataclass(frozen=True)
class GcReport:
    evicted: list[EntryInfo]
    blobs_deleted: int
    bytes_freed: int
    unique_bytes: int  # after (or, for a dry run, as it would be after)
    dry_run: bool
    quarantine_cleared: int = 0  # files check --fix set aside, older than QUARANTINE_DAYS
    unpushed_kept: int = 0  # named sessions no tier holds yet, kept over the budget

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Problem:
    """Something ``check`` found; ``fixed`` when ``check(fix=True)`` repaired it."""

    kind: str
    target: str
    detail: str
    fixed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StoreStats:
    entries: int
    sessions: int
    unique_bytes: int
    referenced_bytes: int
    counters: dict[str, int]
    rates: list[dict[str, Any]] = field(default_factory=list)  # measured here and elsewhere
    decisions: list[dict[str, Any]] = field(default_factory=list)  # restore or recompute
    data_paths: dict[str, str] = field(default_factory=dict)  # machine -> restore path taken
    # this process's host tier (Store(host_cache=...)): HostTier.stats(), counts and bytes
    # and "where" its entries are kept (pinned host memory on CUDA); None without one
    host_cache: dict[str, Any] | None = None

    @property
    def dedup_ratio(self) -> float:
        return self.referenced_bytes / self.unique_bytes if self.unique_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dedup_ratio": self.dedup_ratio}


def _ids(tokens: list[int]) -> str:
    head = ", ".join(str(t) for t in tokens[:4])
    return f"[{head}{', ...' if len(tokens) > 4 else ''}]"


class Rollback(Exception):
    """Raised inside a write transaction to undo it (a dry run) and carry the result."""

    def __init__(self, report: GcReport) -> None:
        self.report = report
