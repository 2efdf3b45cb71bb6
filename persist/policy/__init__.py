"""The resume policy: pure functions over plain records (no disk, no mlx).

Every decision about which stored state may serve a prompt, which snapshot
replaces which, and what to evict lives here, so it can be tested alone;
whether to restore a hit or recompute it is ``policy.recompute``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Literal

from ..errors import NotResumableError

__all__ = [
    "Candidate",
    "Choice",
    "usable_prefix",
    "best_candidate",
    "combine_trimmable",
    "combine_floor",
    "common_offset",
    "could_serve",
    "supersedes",
    "retire",
    "covers",
    "EvictEntry",
    "eviction_key",
    "stronger_hints",
    "plan_eviction",
    "partial_blocks",
]


def combine_trimmable(layers: Iterable[bool]) -> bool:
    """A snapshot is trimmable only if every layer is."""
    return all(layers)


def combine_floor(layers: Iterable[int]) -> int:
    """A snapshot's min resume offset is the highest of its layers'."""
    return max(layers, default=0)


def common_offset(offsets: Iterable[int | None], what: str = "layers") -> int | None:
    """The one offset every layer that reports one agrees on (None: no layer reports one).

    Layers that disagree cannot be one snapshot of one token list.
    """
    found = {o for o in offsets if o is not None}
    if len(found) > 1:
        raise NotResumableError(f"{what} disagree on their offset: {sorted(found)}")
    return found.pop() if found else None


def usable_prefix(
    stored_len: int, lcp: int, prompt_len: int, trimmable: bool, min_resume: int
) -> int:
    """How many positions of a stored snapshot a prompt may reuse (0: none).

    At least one prompt token must remain to produce logits; the prefix may
    not go below the snapshot's floor; and an untrimmable snapshot serves
    only at exactly its own length.
    """
    p = min(lcp, prompt_len - 1, stored_len)
    if p <= 0 or p < min_resume:
        return 0
    if p != stored_len and not trimmable:
        return 0
    return p


@dataclass(frozen=True)
class Candidate:
    id: int
    stored_len: int
    trimmable: bool
    min_resume: int
    used: float = 0.0


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    prefix: int


def could_serve(c: Candidate, matched_at_least: int, prompt_len: int) -> bool:
    """Cheap pre-filter from index columns alone, before tokens or blobs are read.

    ``matched_at_least`` is a lower bound of the common prefix known from the
    chain hashes; an untrimmable snapshot longer than the prompt can never serve.
    """
    if not c.trimmable and c.stored_len > prompt_len - 1:
        return False
    return max(c.min_resume, 1) <= min(c.stored_len, prompt_len - 1)


# ``could_serve`` over the index's columns (table alias ``s``), for the lookup
# queries; bind ``prompt_len - 1`` twice.  A property test checks the two agree.
COULD_SERVE_SQL = (
    "(s.trimmable = 1 OR s.n_tokens <= ?) AND max(s.min_resume, 1) <= min(s.n_tokens, ?)"
)


def best_candidate(cands: Iterable[tuple[Candidate, int]], prompt_len: int) -> Choice | None:
    """The best (candidate, common prefix) pair: longest usable prefix, then an
    exact-length snapshot (nothing to trim), then the most recently used."""
    best: tuple[tuple[int, bool, float, int], Choice] | None = None
    for c, lcp in cands:
        p = usable_prefix(c.stored_len, lcp, prompt_len, c.trimmable, c.min_resume)
        if p == 0:
            continue
        key = (p, p == c.stored_len, c.used, -c.id)
        if best is None or key > best[0]:
            best = (key, Choice(c, p))
    return None if best is None else best[1]


def supersedes(
    new_len: int, new_trimmable: bool, new_floor: int, old_len: int, old_is_prefix: bool
) -> bool:
    """May a new snapshot replace an older one of the same session?

    Only if the new one can be trimmed back to exactly the old one: it is
    trimmable, the old tokens are its prefix, and the old length is not
    below its floor.  An untrimmable snapshot never replaces its ancestors,
    which may be the only entries a later prompt can use.
    """
    return new_trimmable and old_is_prefix and old_len <= new_len and new_floor <= old_len


def retire(
    new_len: int,
    new_trimmable: bool,
    new_floor: int,
    *,
    old_len: int,
    old_is_prefix: bool,
    old_is_checkpoint: bool,
) -> Literal["drop", "keep", "demote"]:
    """What a new save of a session does with one of that session's older snapshots.

    ``drop`` what the new one supersedes; ``keep`` a checkpoint it cannot
    stand in for; ``demote`` the old named snapshot to a checkpoint when it
    is a shorter prefix the new (untrimmable) one cannot serve; else ``drop``
    (the session moved on to other tokens).
    """
    if supersedes(new_len, new_trimmable, new_floor, old_len, old_is_prefix):
        return "drop"
    if old_is_checkpoint:
        return "keep"
    if old_is_prefix and old_len < new_len:
        return "demote"
    return "drop"


def covers(
    new_len: int, new_trimmable: bool, new_floor: int, old_len: int, old_is_prefix: bool
) -> bool:
    """Does a new anonymous prefix entry make an older one redundant?

    The same tokens, or a prefix of them it can be trimmed back to: a server
    that sees one prompt 250 times keeps one entry, not 250.
    """
    if not old_is_prefix:
        return False
    return old_len == new_len or supersedes(new_len, new_trimmable, new_floor, old_len, True)


@dataclass(frozen=True)
class EvictEntry:
    id: int
    used: float
    pinned: bool
    blobs: tuple[str, ...]
    _: KW_ONLY
    ttl: float = 0.0  # a retention hint: kept first for ttl seconds after its last use
    priority: int = 0  # a retention hint: higher is evicted later


def eviction_key(e: EvictEntry, now: float) -> tuple[bool, int, float, int]:
    """The order entries are evicted in, first to last: entries whose retention hint
    has lapsed (or that have none), lowest priority first, least recently used
    first; entries a ttl still protects come last, in the same order.  Hints only
    order: a budget still evicts a protected entry when nothing else is left."""
    return (e.ttl > 0 and e.used + e.ttl > now, e.priority, e.used, e.id)


def stronger_hints(
    a: tuple[float, int] | None, b: tuple[float, int] | None
) -> tuple[float, int] | None:
    """The retention hints (ttl, priority) of an entry that stands in for another (it
    serves the other's prefix): the longer ttl and the higher priority of the two."""
    if a is None or b is None:
        return a if b is None else b
    return max(a[0], b[0]), max(a[1], b[1])


def plan_eviction(
    entries: Sequence[EvictEntry],
    blob_sizes: dict[str, int],
    budget: int,
    protect: frozenset[int] = frozenset(),
    now: float = 0.0,
) -> list[int]:
    """Unpinned entries to drop, in ``eviction_key`` order (at ``now``; without hints:
    least recently used first), until unique bytes fit ``budget``.

    Bytes are unique bytes on disk: a blob is freed when the last entry that
    references it goes.  Pinned and protected entries are never chosen.
    """
    refs: dict[str, int] = {}
    for e in entries:
        for b in set(e.blobs):
            refs[b] = refs.get(b, 0) + 1
    total = sum(blob_sizes.get(b, 0) for b in refs)
    out = []
    for e in sorted(entries, key=lambda e: eviction_key(e, now)):
        if total <= budget:
            break
        if e.pinned or e.id in protect:
            continue
        out.append(e.id)
        for b in set(e.blobs):
            refs[b] -= 1
            if refs[b] == 0:
                total -= blob_sizes.get(b, 0)
    return out


def partial_blocks(
    keep: int | None, n_tokens: int, n_blocks: int, block: int, split: bool
) -> int | None:
    """How many leading blocks a hit of ``keep`` tokens reads, or None for the whole
    snapshot: a hit shorter than the snapshot that ends within its full blocks reads
    the blocks covering [0, keep) and the tail's other tensors, nothing more."""
    if keep is None or keep >= n_tokens or not split or keep > n_blocks * block:
        return None
    return -(-keep // block)
