"""A store that restores what it saves soon (``persist serve``) writes its blobs through
the page cache: after a restart its restores read memory, not the disk (issue 39).
Other stores keep O_DIRECT for large blobs where the filesystem allows it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

import persist
from persist.format.sink import DIRECT_MIN_BYTES, Sink
from tests.helpers import assert_same_state, live_state, prefill, tokens_for

O_DIRECT = getattr(os, "O_DIRECT", 0)


def _flags_of_a_large_blob(store: persist.Store) -> int:
    seen: list[int] = []

    def write(sink: Sink) -> None:
        seen.append(fcntl.fcntl(sink.fd, fcntl.F_GETFL))
        sink.write(b"\x01" * DIRECT_MIN_BYTES)
        sink.finish()

    lease = store.blobs.lease()
    try:
        store.blobs.put("ab" + "0" * 30, write, DIRECT_MIN_BYTES, lease.salt)
    finally:
        lease.release()
    return seen[0]


def test_cached_writes_never_skip_the_page_cache(tmp_path: Path) -> None:
    if not O_DIRECT:
        pytest.skip("no O_DIRECT on this platform: every write goes through the page cache")
    probe = Sink(tmp_path / "probe", size_hint=DIRECT_MIN_BYTES)
    probe.close()
    if not probe.direct:
        pytest.skip("this filesystem refuses O_DIRECT: every write goes through the page cache")
    with persist.Store(tmp_path / "direct") as store:
        assert _flags_of_a_large_blob(store) & O_DIRECT
    with persist.Store(tmp_path / "cached", cached_writes=True) as store:
        assert not _flags_of_a_large_blob(store) & O_DIRECT


def test_a_cached_write_restores_bit_for_bit(tiny: object, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")  # type: ignore[operator]
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=94)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "s", cached_writes=True, block_tokens=256) as store:
        store.save(cache, toks, identity=ident, session="s")
    with persist.Store(tmp_path / "s") as store:
        got = store.restore("s", identity=ident)
    assert got.tokens == toks
    assert_same_state(live_state(got.cache), live_state(cache))
