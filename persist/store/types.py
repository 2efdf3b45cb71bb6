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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Restored:
    """A restored cache (fresh objects), the tokens it covers, and its entry."""

    cache: list[Any]
    tokens: list[int]
    entry: EntryInfo


@dataclass(frozen=True)
class GcReport:
    evicted: list[EntryInfo]
    blobs_deleted: int
    bytes_freed: int
    unique_bytes: int  # after (or, for a dry run, as it would be after)
    dry_run: bool

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

    @property
    def dedup_ratio(self) -> float:
        return self.referenced_bytes / self.unique_bytes if self.unique_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dedup_ratio": self.dedup_ratio}
