"""``persist stats`` counts every file of a store by part, and only the store's."""

from __future__ import annotations

import os
from pathlib import Path

from persist.storage.housekeeping import files_bytes


def put(path: Path, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * n)


def test_every_file_is_counted_in_its_part_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "s"
    put(root / "index.sqlite", 100)
    put(root / "index.sqlite-wal", 20)
    put(root / "reserve", 7)
    put(root / "blobs" / "ab" / "k.1.safetensors", 1000)
    put(root / "blobs" / "cd" / "k.2.safetensors", 300)
    put(root / "tmp" / "1-0123456789abcdef.tmp", 5)
    put(root / "quarantine" / "1-x", 3)
    put(root / "identity" / "memo", 10_000)  # persist's identity memo: not the store's
    put(root / "demo-llama" / "model.safetensors", 10_000)  # the demo model: neither
    put(tmp_path / "elsewhere" / "big", 50_000)
    os.symlink(tmp_path / "elsewhere", root / "blobs" / "ef")  # a link is never followed
    assert files_bytes(root) == {
        "index": 120,
        "blobs": 1300,
        "other": 7 + 5 + 3,
        "total": 120 + 1300 + 15,
        "wal": 20,  # a part of the index's bytes, shown apart
    }
    none = {"index": 0, "blobs": 0, "other": 0, "total": 0, "wal": 0}
    assert files_bytes(tmp_path / "none") == none
