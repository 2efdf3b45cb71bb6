"""The ``blobs/ab/`` folders and the blob files in them are judged as the store is.

Attack 38, finding 9: a ``blobs/ab/`` folder or a blob file that every user
could write, or that another user owned, was used as it was.  A swapped blob is
caught by its checksums (no wrong cache), but that user could delete or replace
the files and so lose sessions: a restore, a save into such a folder and
``persist check`` now refuse or report it, as they do the store's root.
Real files, chmod and (as root) chown to a uid no one has.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli

OTHER = 12345  # a uid no one on the test machine has


def saved(root: Path) -> tuple[Path, Path]:
    """A store holding session ``chat``; its one blob subfolder and blob file."""
    with persist.Store(root) as store:
        store.save([kv_cache(8)], list(range(8)), identity=IDENTITY, session="chat")
    (sub,) = [p for p in (root / "blobs").iterdir() if p.is_dir()]
    files = sorted(sub.iterdir())
    return sub, files[0]


def spoil(p: Path, how: str) -> None:
    if how == "o+w":
        os.chmod(p, os.stat(p).st_mode | 0o002)
    else:
        os.chown(p, OTHER, OTHER)


HOWS = [
    "o+w",
    pytest.param(
        "other-owner",
        marks=pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root"),
    ),
]


@pytest.mark.parametrize("part", ["subfolder", "file"])
@pytest.mark.parametrize("how", HOWS)
def test_a_restore_refuses_a_blob_part_another_user_can_change(
    tmp_path: Path, part: str, how: str
) -> None:
    root = tmp_path / "store"
    sub, blob = saved(root)
    target = sub if part == "subfolder" else blob
    spoil(target, how)
    with persist.Store(root) as store, pytest.raises(persist.UnsafeStoreError) as e:
        store.restore("chat", identity=IDENTITY)
    assert str(target) in str(e.value)
    out = persist_cli(tmp_path, "check", "--store", str(root), check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "unsafe" in out.stdout and str(target) in out.stdout, out.stdout
    fixed = persist_cli(tmp_path, "check", "--fix", "--store", str(root), check=False)
    assert "Traceback" not in fixed.stderr
    assert target.exists(), "check never deletes what another user could change"


def test_a_save_into_a_subfolder_every_user_can_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    for i in range(256):  # whichever subfolder the new blob's key picks
        sub = root / "blobs" / f"{i:02x}"
        sub.mkdir(exist_ok=True)
        os.chmod(sub, 0o777)
    with persist.Store(root) as store:
        with pytest.raises(persist.UnsafeStoreError, match="every user"):
            store.save([kv_cache(8, seed=7)], list(range(8)), identity=IDENTITY, session="again")
        assert [s.session for s in store.sessions()] == ["chat"]


def test_a_private_store_passes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    with persist.Store(root) as store:
        assert store.restore("chat", identity=IDENTITY).tokens == list(range(8))
    assert "store is consistent" in persist_cli(tmp_path, "check", "--store", str(root)).stdout


def test_check_beside_a_gc_that_removes_a_blob_it_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full suite's race test: check's owner pass listed a blob file that a
    concurrent gc then removed, and check raised FileNotFoundError."""
    from persist.storage import blobs as blob_files

    root = tmp_path / "store"
    _, blob = saved(root)
    listed = blob_files._entries

    def then_removed(d: Path) -> list[os.DirEntry[str]]:
        out = listed(d)
        if d == blob.parent and blob.exists():
            blob.unlink()  # removed after it was listed, before it is looked at
        return out

    monkeypatch.setattr(blob_files, "_entries", then_removed)
    with persist.Store(root) as store:
        assert [p for p in store.blobs.parts() if p[0] == blob] == []
