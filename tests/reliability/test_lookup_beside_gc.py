"""Attack 38b, finding 11: a lookup beside ``persist gc`` (or ``check --fix``) in another
process logged "skipping a damaged snapshot: index row does not match its checksum" or
"blob file is missing" for a healthy store, and counted ``corrupt_skipped`` (the
counter an operator alarms on): the row it chose had been evicted between the read of
the row and the read of its blocks or blobs.  A row a concurrent delete removed is a
miss, not damage; a row still there that does not check is damage, as before.

The interleaving is made exact: the lookup's own reads are wrapped so that a real
``persist gc --max-bytes 0`` process runs at the chosen point (after the row is read,
or after its blocks are), on the same store, through SQLite.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.engine import reading
from persist.storage.index import Index
from tests.golden.cases import IDENTITY, kv_cache
from tests.helpers import persist_cli

TOKS = list(range(40))


def evict_all(tmp: Path, root: Path) -> None:
    """Another process evicts every entry and deletes their blob files."""
    persist_cli(tmp, "gc", "--max-bytes", "0", "--store", str(root))


def lookup_beside_gc(tmp: Path, caplog: Any) -> tuple[Any, dict[str, int], list[str]]:
    root = tmp / "s"
    with persist.Store(root) as s:
        s.save([kv_cache(40, 1)], TOKS, identity=IDENTITY)
        with caplog.at_level(logging.WARNING, logger="persist"):
            got = s.lookup([*TOKS, 7], identity=IDENTITY)
        counters = s.stats().counters
    said = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    return got, counters, said


def test_a_row_evicted_before_its_blocks_are_read_is_a_miss(
    tmp_path: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = reading.load_snapshot

    def gc_first(index: Any, blobs: Any, row: Any, *a: Any, **k: Any) -> Any:
        evict_all(tmp_path, tmp_path / "s")  # the row is read; gc takes it
        return original(index, blobs, row, *a, **k)

    monkeypatch.setattr(reading, "load_snapshot", gc_first)
    got, counters, said = lookup_beside_gc(tmp_path, caplog)
    assert (got, said, counters.get("corrupt_skipped", 0)) == (None, [], 0)
    assert counters["misses"] == 1


def test_a_blob_deleted_with_its_row_is_a_miss(
    tmp_path: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Index.verified_blocks

    def gc_after(self: Index, row: Any) -> Any:
        blocks = original(self, row)
        evict_all(tmp_path, tmp_path / "s")  # the blocks are read; gc takes row and blobs
        return blocks

    monkeypatch.setattr(Index, "verified_blocks", gc_after)
    got, counters, said = lookup_beside_gc(tmp_path, caplog)
    assert (got, said, counters.get("corrupt_skipped", 0)) == (None, [], 0)
    assert counters["misses"] == 1


def test_a_row_still_there_that_does_not_check_is_damage(
    tmp_path: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Index.verified_blocks

    def blob_lost(self: Index, row: Any) -> Any:
        blocks = original(self, row)
        for f in {row.tail, *(b.blob for b in blocks if b.blob)}:
            (tmp_path / "s" / "blobs" / f[:2] / f"{f}.safetensors").unlink()
        return blocks

    monkeypatch.setattr(Index, "verified_blocks", blob_lost)
    got, counters, said = lookup_beside_gc(tmp_path, caplog)
    assert got is None and counters["corrupt_skipped"] == 1 and len(said) == 1
