"""``persist check`` beside a saver of the same store (outside attack r13c, F3).

Check reads its blob rows in one view, then looks at the files.  A save that
committed in between (the session saved again: its old blobs unreferenced,
then deleted, as the write order says) left a row live in check's view whose
file was gone, and ``check --fix`` reported "damaged-blob ... blob file is
missing; used by no session (only prefixes)" on a healthy store.  The save is
injected at that moment from a second store object (its own SQLite
connection), as another process's save would land.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from persist.storage import check as check_module
from tests.golden.cases import IDENTITY
from tests.reliability.race_child import version


@pytest.mark.parametrize("fix", [False, True])
def test_blobs_a_save_collected_after_checks_view_are_not_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fix: bool
) -> None:
    root = tmp_path / "store"
    tokens, cache = version("s", 300)
    with persist.Store(root) as store:
        store.save([cache], tokens, identity=IDENTITY, session="s")
        real = check_module.damaged

        def damaged(*args: Any, **kw: Any) -> dict[str, str]:
            new_tokens, new = version("s", 41)  # another turn: the old blobs collected
            with persist.Store(root) as other:
                other.save([new], new_tokens, identity=IDENTITY, session="s")
            return real(*args, **kw)

        monkeypatch.setattr(check_module, "damaged", damaged)
        problems = store.check(fix=fix)
        assert [p for p in problems if p.kind == "damaged-blob"] == []
        monkeypatch.setattr(check_module, "damaged", real)
        assert store.check() == []
        assert store.restore("s", identity=IDENTITY).tokens == version("s", 41)[0]


def test_blobs_a_save_is_collecting_are_not_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # attack r14, B1: `persist check` beside a saver reported "orphan-blob ... no index
    # entry" (a blob collected between check's listing and its read of the rows) and
    # "unreferenced, awaiting deletion" (a save's commit unreferenced it, its collect
    # had not run yet) on a healthy store, and exited 1
    from persist.storage import retention

    root = tmp_path / "store"
    tokens, cache = version("s", 300)
    with persist.Store(root) as store:
        store.save([cache], tokens, identity=IDENTITY, session="s")
        real_rows = store.index.blob_rows_and_pending
        real_collect = retention.collect
        turn = [41]

        def rows_after_a_save() -> Any:  # lands after check listed the files
            if turn:
                new_tokens, new = version("s", turn.pop())
                with persist.Store(root) as other:
                    other.save([new], new_tokens, identity=IDENTITY, session="s")
            return real_rows()

        store.index.blob_rows_and_pending = rows_after_a_save  # type: ignore[method-assign]
        assert [p for p in store.check() if p.kind == "orphan-blob"] == []
        store.index.blob_rows_and_pending = real_rows  # type: ignore[method-assign]
        monkeypatch.setattr(retention, "collect", lambda index, blobs: 0)  # not yet
        new_tokens, new = version("s", 77)
        store.save([new], new_tokens, identity=IDENTITY, session="s")  # its collect pending
        monkeypatch.setattr(retention, "collect", real_collect)
        assert store.check() == []
        assert store.restore("s", identity=IDENTITY).tokens == new_tokens


@pytest.mark.parametrize("fix", [False, True])
def test_a_save_that_ends_while_check_claims_its_lease_is_not_a_dead_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fix: bool
) -> None:
    # attack r15, F2: check listed tmp/ (a save's lease and partial write), the save
    # then ended as it should (its blob renamed into place, its lease released), and
    # the claim of a lease no longer there came back free: "a dead save's lease, its
    # writer is gone" and "partial write" on a healthy store, 19 of 7,256 checks
    from persist.storage import leases

    root = tmp_path / "store"
    with persist.Store(root) as store:
        tmp = store.blobs.tmp
        lease = leases.take(tmp)
        partial = tmp / f"{lease.salt}.{'0' * 16}.tmp"
        partial.write_bytes(b"a blob being written")
        real = leases.claim

        def claim(*args: Any, **kw: Any) -> Any:  # the save ends just before the claim
            if lease.fd >= 0:
                partial.unlink()  # renamed into place
                lease.release()
            return real(*args, **kw)

        monkeypatch.setattr(leases, "claim", claim)
        problems = store.check(fix=fix)
        assert [p for p in problems if p.kind == "orphan-tmp"] == []
        monkeypatch.setattr(leases, "claim", real)
        assert store.check() == []
