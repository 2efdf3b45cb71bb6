"""Store fixtures shared by the store tests."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import persist
from persist.codecs import encode_cache, trim_record
from persist.codecs.snapshot import rebuild
from tests.helpers import raw

# What a killed writer may leave behind, and nothing else.
CRASH_DEBRIS = frozenset({"orphan-tmp", "orphan-blob", "stale-pending"})


def assert_private(root: Path) -> None:
    """Every directory 0700 and every file 0600 under ``root``."""
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            assert stat.S_IMODE((Path(dirpath) / d).stat().st_mode) == 0o700, d
        for f in files:
            assert stat.S_IMODE((Path(dirpath) / f).stat().st_mode) == 0o600, f


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blobs").rglob("*.safetensors"))


def clean(store: persist.Store) -> None:
    problems = store.check()
    assert problems == [], problems
    assert store.stats().unique_bytes == disk_bytes(store.root)


def full_then_trim(store: persist.Store, session: str, ident: Any, k: int) -> list[Any]:
    whole = store.restore(session, identity=ident).cache
    return rebuild([trim_record(encode_cache(c), k) for c in whole])


def whole_buffers(cache: list[Any]) -> list[list[tuple[tuple[int, ...], bytes]]]:
    """Every layer's key/value buffers, room past the offset included."""
    out = []
    for c in cache:
        arrays: list[Any] = []
        for name in ("keys", "values"):
            v = getattr(c, name, None)
            arrays += list(v) if isinstance(v, (tuple, list)) else [] if v is None else [v]
        out.append([(tuple(a.shape), raw(a)) for a in arrays])
    return out


def flip(path: Path, at: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def block_blob(store: persist.Store, name: str, idx: int) -> Path:
    row = store.index.by_name("default", name)
    assert row is not None
    blob = next(b.blob for b in store.index.blocks(row.id) if b.idx == idx)
    assert blob is not None
    return store.blobs.path(blob)


def steps(store: persist.Store, run: Callable[[], Any]) -> int:
    """SQLite VM instructions ``run`` executes on the store's connection."""
    n = [0]

    def tick() -> int:
        n[0] += 1
        return 0

    store.index.db.conn.set_progress_handler(tick, 1)
    try:
        run()
    finally:
        store.index.db.conn.set_progress_handler(None, 1)
    return n[0]


def saved_sessions(root: Path, *names: str, **tiers: Any) -> None:
    """A store at ``root`` (with ``tiers``) holding a 16-token session for each name."""
    from tests.golden.cases import IDENTITY, kv_cache

    with persist.Store(root, **tiers) as s:
        for i, n in enumerate(names):
            s.save([kv_cache(16, i)], list(range(i, i + 16)), identity=IDENTITY, session=n)


def sessions_left(root: Path) -> list[str]:
    """The named sessions the store at ``root`` holds, sorted."""
    with persist.Store(root) as s:
        return sorted(str(e.session) for e in s.sessions())
