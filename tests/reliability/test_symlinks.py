"""Links planted in a store are never followed: check reports them and touches nothing else.

Round 1's ``check --fix`` deleted every entry of ``tmp/`` and moved every
odd file under ``blobs/<dir>/`` to quarantine, through directory links: a
``tmp -> ~/Documents`` planted by anyone who can write the store root
deleted the owner's documents.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs


def victim(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    for f in ("notes.txt", "123-0123456789abcdef.tmp", "x.safetensors"):
        (d / f).write_text("precious")
    return d


def tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def test_check_fix_never_follows_planted_links(tmp_path: Path) -> None:
    root = tmp_path / "store"
    c = mc.KVCache()
    c.update_and_fetch(*kvs(1, 300))
    with persist.Store(root) as s:
        s.save([c], list(range(300)), identity=IDENTITY, session="keep")
    docs, more = victim(tmp_path, "docs"), victim(tmp_path, "more")
    before = (tree(docs), tree(more))
    os.rmdir(root / "tmp")
    (root / "tmp").symlink_to(docs)
    (root / "blobs" / "zz").symlink_to(more)
    sub = next(p for p in (root / "blobs").iterdir() if p.is_dir() and not p.is_symlink())
    (sub / "0123456789abcdef0123456789abcdef.0123456789ab.safetensors").symlink_to(
        docs / "x.safetensors"
    )
    with persist.Store(root) as s:
        problems = s.check(fix=True)
        kinds = {p.kind for p in problems}
        assert "symlink" in kinds, problems
        assert len([p for p in problems if p.kind == "symlink"]) == 3
        assert (tree(docs), tree(more)) == before  # nothing of theirs touched
        assert s.restore("keep", identity=IDENTITY).tokens == list(range(300))
        other = mc.KVCache()
        other.update_and_fetch(*kvs(2, 300))  # new bytes: a write, refused through the link
        with pytest.raises(persist.PersistError, match="symbolic link"):
            s.save([other], list(range(300)), identity=IDENTITY, session="new")
    assert (tree(docs), tree(more)) == before


def test_index_behind_a_dangling_link_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    target = tmp_path / "elsewhere" / "planted.sqlite"
    target.parent.mkdir()
    (root / "index.sqlite").symlink_to(target)
    with pytest.raises(persist.CorruptBlobError, match="symbolic link"):
        persist.Store(root)
    assert not target.exists()
