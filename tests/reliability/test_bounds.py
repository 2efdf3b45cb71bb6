"""Odd and huge inputs get typed errors, never raw struct, sqlite or recursion errors."""

from __future__ import annotations

import sqlite3
import struct
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.errors import InvalidTokensError
from tests.golden.cases import IDENTITY
from tests.golden.cases import kv_cache as kv


@pytest.mark.parametrize("bad", [[-1], [1 << 32], [3, 1.5], ["7"], [None]])
def test_invalid_token_ids_are_typed(bad: list[Any], tmp_path: Path) -> None:
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(InvalidTokensError) as e:
            store.lookup(bad * 20, identity=IDENTITY)
        assert isinstance(e.value, persist.PersistError) and isinstance(e.value, ValueError)
        with pytest.raises(InvalidTokensError):
            store.save([kv(20 * len(bad))], bad * 20, identity=IDENTITY, session="x")
        assert store.sessions() == [] and store.check() == []


def test_the_largest_token_id_round_trips(tmp_path: Path) -> None:
    toks = [(1 << 32) - 1 - i for i in range(40)]
    with persist.Store(tmp_path / "s") as store:
        store.save([kv(40)], toks, identity=IDENTITY, session="big")
        assert store.restore("big", identity=IDENTITY).tokens == toks
        hit = store.lookup([*toks[:30], 5, 6], identity=IDENTITY)
        assert hit is not None and hit.tokens == toks[:30]


def test_huge_prompt_lookups_bound_their_queries(tmp_path: Path) -> None:
    """300k tokens (1,171 blocks) under SQLite's old limit of 999 variables a query."""
    with persist.Store(tmp_path / "s") as store:
        store.index.db.conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        stored = list(range(600))
        store.save([kv(600)], stored, identity=IDENTITY, session="a")
        prompt = stored[:550] + [7] * 300_000
        hit = store.lookup(prompt, identity=IDENTITY)
        assert hit is not None and len(hit.tokens) == 550
        prompt = [9] * 300_000  # no block in common at all
        assert store.lookup(prompt, identity=IDENTITY) is None


def test_deeply_nested_header_is_refused_typed(tmp_path: Path) -> None:
    body = b"[" * 50_000 + b"]" * 50_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(persist.CorruptBlobError, match="nests deeper"):
        persist.load_file(path)
    with pytest.raises(persist.CorruptBlobError):
        persist.read_manifest(path)


def test_a_header_of_too_many_tensors_is_refused_before_parsing(tmp_path: Path) -> None:
    entry = '"t%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    body = ("{" + ",".join(entry % i for i in range(70_000)) + "}").encode()
    path = tmp_path / "many.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(persist.CorruptBlobError, match="more than 65536 tensors"):
        persist.load_file(path)
