"""Ctrl-C at the worst moment of a save: right after the index COMMIT.

Round 1's cleanup ran on any exception and unlinked the blobs the committed
snapshot uses.  Cleanup now asks the index whether the save committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import raw
from tests.store_helpers import CRASH_DEBRIS


def interrupt_after_commit(store: persist.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    db = store.index.db
    real = db.execute
    state = {"inserted": False}

    def execute(sql: str, *a: Any, **k: Any) -> Any:
        out = real(sql, *a, **k)
        if sql.startswith("INSERT INTO snapshots("):
            state["inserted"] = True
        elif sql == "COMMIT" and state["inserted"]:
            state["inserted"] = False
            raise KeyboardInterrupt  # as if SIGINT arrived as COMMIT returned
        return out

    monkeypatch.setattr(db, "execute", execute)


@pytest.mark.parametrize("n", [40, 700])
def test_sigint_right_after_commit_keeps_the_session(
    n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = mc.KVCache()
    keys, values = kvs(5, n)
    c.update_and_fetch(keys, values)
    with persist.Store(tmp_path / "s") as store:
        interrupt_after_commit(store, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            store.save([c], list(range(n)), identity=IDENTITY, session="work")
        monkeypatch.undo()
        got = store.restore("work", identity=IDENTITY)  # committed: it must restore
        assert raw(got.cache[0].keys[..., :n, :]) == raw(keys)
        assert {p.kind for p in store.check()} <= CRASH_DEBRIS
        store.check(fix=True)
        assert store.check() == []
        assert store.restore("work", identity=IDENTITY).tokens == list(range(n))
