"""``Store.export`` beside a save of the same session (outside attack r13b).

The export read the session's row, then its blobs in a later step: a save
committed between the two removed the old version's blobs, and the export said
CorruptBlobError ("blob file is missing") on a healthy store, in 39 of 40
``persist export`` runs beside a saver in a tight loop.  A restore re-reads
a session replaced meanwhile; an export must too: the old turn or the new one,
never a false report of damage.  The save is injected at that moment, between
the row's read and the first read of its blobs, from a second store object
(its own SQLite connection), as another process's save would land.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY
from tests.helpers import raw
from tests.reliability.race_child import version


def _save_on_first_blob_read(store: persist.Store, root: Path, n: int) -> list[int]:
    """Make the next blob read of ``store`` wait for a save of "s" with ``n`` tokens."""
    done: list[int] = []
    index = store.index
    real = index.blob_head

    def blob_head(name: str) -> Any:
        if not done:
            done.append(n)
            tokens, cache = version("s", n)
            with persist.Store(root) as other:
                other.save([cache], tokens, identity=IDENTITY, session="s")
        return real(name)

    index.blob_head = blob_head  # type: ignore[method-assign]
    return done


@pytest.mark.parametrize("fmt", ["persist", "mlx-lm"])
def test_an_export_beside_a_save_of_its_session_writes_a_whole_version(
    tmp_path: Path, fmt: str
) -> None:
    root = tmp_path / "store"
    old_tokens, old = version("s", 300)
    with persist.Store(root) as store:
        store.save([old], old_tokens, identity=IDENTITY, session="s")
        injected = _save_on_first_blob_read(store, root, 41)  # a shorter, other turn
        out = tmp_path / "s.safetensors"
        if fmt == "persist":
            info = store.export("s", out)
            got = persist.load_file(out)
            new_tokens, new = version("s", 41)
            assert injected == [41]
            assert info.tokens == len(got.tokens) == 41 and got.tokens == new_tokens
            assert raw(got.cache[0].keys[..., :41, :]) == raw(new.keys[..., :41, :])
        else:  # an mlx-lm file claims a model folder: this identity records none
            with pytest.raises(persist.errors.InvalidArgumentError):
                store.export("s", out, format="mlx-lm")
        assert store.check() == []


def test_an_export_of_a_session_deleted_meanwhile_is_not_found(tmp_path: Path) -> None:
    root = tmp_path / "store"
    tokens, cache = version("s", 300)
    with persist.Store(root) as store:
        store.save([cache], tokens, identity=IDENTITY, session="s")
        real = store.index.blob_head

        def blob_head(name: str) -> Any:
            with persist.Store(root) as other:
                if other.sessions():
                    other.delete("s")
            return real(name)

        store.index.blob_head = blob_head  # type: ignore[method-assign]
        with pytest.raises(persist.SessionNotFoundError):
            store.export("s", tmp_path / "s.safetensors")
        assert not (tmp_path / "s.safetensors").exists()
