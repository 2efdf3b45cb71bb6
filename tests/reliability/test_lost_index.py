"""An index that lost its tables beside a full blobs/ is refused, never opened as a new store.

Round 3: a 0-byte ``index.sqlite`` beside a full ``blobs/`` was opened as a
new, empty store, and ``check --fix`` then deleted every blob as an orphan,
irreversibly.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import persist_cli


def saved(root: Path) -> list[Path]:
    c = mc.KVCache()
    c.update_and_fetch(*kvs(1, 600))
    with persist.Store(root) as s:
        s.save([c], list(range(600)), identity=IDENTITY, session="keep")
    return sorted((root / "blobs").rglob("*.safetensors"))


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_an_index_without_tables_beside_blobs_is_refused(tmp_path: Path, how: str) -> None:
    root = tmp_path / "store"
    blobs = saved(root)
    for suffix in ("", "-wal", "-shm"):
        (root / f"index.sqlite{suffix}").unlink(missing_ok=True)
    if how == "empty":
        (root / "index.sqlite").write_bytes(b"")
    with pytest.raises(persist.CorruptBlobError, match="no tables") as got:
        persist.Store(root)
    assert "mv " in str(got.value)  # the command to start afresh, not a deletion
    for args in (["check", "--fix"], ["ls"], ["gc"]):
        out = persist_cli(root, *args, check=False)
        assert out.returncode == 1 and "no tables" in out.stderr, out
    assert sorted((root / "blobs").rglob("*.safetensors")) == blobs  # nothing deleted


def test_check_fix_keeps_blobs_an_emptied_index_cannot_vouch_for(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blobs = saved(root)
    db = sqlite3.connect(root / "index.sqlite")
    with db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            if table not in ("meta", "namespaces") and not table.startswith("sqlite_"):
                db.execute(f"DELETE FROM {table}")
    db.close()
    with persist.Store(root) as s:
        problems = s.check(fix=True)
    assert [p.kind for p in problems] == ["unvouched-blobs"] and not problems[0].fixed
    assert sorted((root / "blobs").rglob("*.safetensors")) == blobs


def test_a_damaged_index_names_the_command_that_saves_what_is_readable(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    data = bytearray((root / "index.sqlite").read_bytes())
    data[:16] = b"not a database!!"
    (root / "index.sqlite").write_bytes(bytes(data))
    with pytest.raises(persist.CorruptBlobError, match=r"\.recover"):
        persist.Store(root)
