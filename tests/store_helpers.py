"""Store fixtures shared by the store tests."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import persist

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
