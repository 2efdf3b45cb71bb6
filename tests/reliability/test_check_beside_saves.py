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
