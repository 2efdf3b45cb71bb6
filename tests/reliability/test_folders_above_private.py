"""A private folder is private only if no other user can rename it away: every folder
above the weights-digest memo and above a store is checked the way ssh checks the
folders above ``~/.ssh`` (owned by root or you, written by no one else unless sticky),
and the memo is read through the very descriptor that was checked.

An outside attack renamed a 0700 memo folder aside inside its 0777 parent and put a
link to a folder of its own in its place, between persist's check and its read:
another model's digest was trusted (and that model's caches served as this one's).
Folders owned by another uid need root (``os.chown``); elsewhere those tests skip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import persist
from persist import weights_memo
from tests.helpers import persist_cli

OTHER = 12345  # a uid no one on the test machine has
KEY, REAL, PLANTED = "k" * 64, "a" * 32, "b" * 32
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def memo_below(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int) -> Path:
    """A 0700 memo folder of this user inside ``shared`` (given ``mode``), its digest written."""
    shared = tmp_path / "shared"
    shared.mkdir()
    memo = shared / "ids"
    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(memo))
    weights_memo.remember(KEY, REAL)
    assert weights_memo.recall(KEY) == REAL
    os.chmod(shared, mode)
    return memo


def test_a_memo_below_a_folder_every_user_can_write_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo_below(tmp_path, monkeypatch, 0o777)
    assert weights_memo.recall(KEY) is None


def test_a_memo_below_a_sticky_folder_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo_below(tmp_path, monkeypatch, 0o1777)  # as /tmp: only an entry's owner renames it
    assert weights_memo.recall(KEY) == REAL


@root_only
def test_a_memo_below_another_users_folder_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo_below(tmp_path, monkeypatch, 0o755)
    os.chown(tmp_path / "shared", OTHER, OTHER)  # its owner may rename what it holds
    assert weights_memo.recall(KEY) is None


def test_a_memo_is_not_written_below_a_folder_every_user_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo = memo_below(tmp_path, monkeypatch, 0o777)
    weights_memo.remember("c" * 64, REAL)
    assert not (memo / f"{'c' * 64}.json").exists()


def planted(tmp_path: Path, mode: int) -> Path:
    """A folder holding another digest for KEY, as the other user would make it."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / f"{KEY}.json").write_text(json.dumps({"weights": PLANTED}))
    os.chmod(theirs, mode)
    return theirs


def swap_after_check(monkeypatch: pytest.MonkeyPatch, swap: Callable[[Path], None]) -> None:
    """Run ``swap(memo folder)`` right after recall's check of it said yes."""
    real = weights_memo._trusted

    def checked_then_swapped(d: Path) -> bool:
        ok = real(d)
        swap(d)
        return ok

    monkeypatch.setattr(weights_memo, "_trusted", checked_then_swapped)


def test_a_memo_folder_swapped_for_a_link_after_its_check_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo_below(tmp_path, monkeypatch, 0o700)
    theirs = planted(tmp_path, 0o700)

    def to_link(d: Path) -> None:
        os.rename(d, d.with_name("ids.aside"))
        d.symlink_to(theirs)

    swap_after_check(monkeypatch, to_link)
    assert weights_memo.recall(KEY) is None


def test_a_memo_folder_swapped_for_an_open_folder_after_its_check_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo_below(tmp_path, monkeypatch, 0o700)
    theirs = planted(tmp_path, 0o777)  # a folder anyone can fill

    def to_folder(d: Path) -> None:
        os.rename(d, d.with_name("ids.aside"))
        os.rename(theirs, d)

    swap_after_check(monkeypatch, to_folder)
    assert weights_memo.recall(KEY) is None


def store_below(tmp_path: Path, mode: int, *, linked: bool = False) -> Path:
    """A store of this user at ``shared/store`` (or a link there to one elsewhere)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    root = shared / "store"
    if linked:
        (tmp_path / "real").mkdir()
        persist.Store(tmp_path / "real" / "store").close()
        root.symlink_to(tmp_path / "real" / "store")
    else:
        persist.Store(root).close()
    os.chmod(shared, mode)
    return root


@pytest.mark.parametrize("linked", [False, True], ids=["folder", "link"])
def test_a_store_below_a_folder_every_user_can_write_is_refused(
    tmp_path: Path, linked: bool
) -> None:
    root = store_below(tmp_path, 0o777, linked=linked)
    with pytest.raises(persist.UnsafeStoreError, match="every user"):
        persist.Store(root)


def test_a_store_below_a_folder_every_user_can_write_is_refused_by_the_cli(
    tmp_path: Path,
) -> None:
    root = store_below(tmp_path, 0o777)
    out = persist_cli(tmp_path, "ls", "--store", str(root), check=False)
    assert (out.returncode, "Traceback" in out.stderr) == (1, False), out.stderr
    assert f"refusing the store: {tmp_path / 'shared'}, a folder above it, " in out.stderr


def test_a_store_below_a_sticky_folder_is_used(tmp_path: Path) -> None:
    root = store_below(tmp_path, 0o1777)
    persist.Store(root).close()


def test_a_store_linked_to_below_a_folder_every_user_can_write_is_refused(
    tmp_path: Path,
) -> None:
    """The link is the user's own, in a private folder; where it leads is not."""
    (tmp_path / "open").mkdir()
    persist.Store(tmp_path / "open" / "store").close()
    os.chmod(tmp_path / "open", 0o777)
    (tmp_path / "mine").mkdir(mode=0o700)
    (tmp_path / "mine" / "store").symlink_to(tmp_path / "open" / "store")
    with pytest.raises(persist.UnsafeStoreError, match="every user"):
        persist.Store(tmp_path / "mine" / "store")


@root_only
def test_a_store_below_another_users_folder_is_refused(tmp_path: Path) -> None:
    root = store_below(tmp_path, 0o755)
    os.chown(tmp_path / "shared", OTHER, OTHER)
    with pytest.raises(persist.UnsafeStoreError, match=f"owned by user {OTHER}"):
        persist.Store(root)
