"""A restore reads its blobs on several threads: still exact, all-or-nothing, bounded."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.engine import blob_reads, loading
from persist.format import tensors
from tests.helpers import live_state, prefill, tokens_for

BLOCK = 16  # 300 tokens -> 18 blocks and a tail: more pieces than the read queue holds


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def saved(tiny: Any, root: Path, n: int = 300) -> tuple[persist.Store, persist.ModelIdentity, Any]:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(n, seed=41)
    cache = prefill(model, toks)[0]
    store = persist.Store(root, block_tokens=BLOCK)
    store.save(cache, toks, identity=identity, session="s")
    return store, identity, cache


def test_more_pieces_than_workers_restore_exactly(tiny: Any, tmp_path: Path) -> None:
    store, identity, cache = saved(tiny, tmp_path / "s")
    with store:
        assert store.index.by_name("default", "s").n_blocks > 2 * loading.WORKERS  # type: ignore[union-attr]
        assert live_state(store.restore("s", identity=identity).cache) == live_state(cache)


@pytest.mark.parametrize("which", [0, 9, -1])
def test_damage_in_any_block_refuses_the_whole_restore(
    which: int, tiny: Any, tmp_path: Path
) -> None:
    store, identity, cache = saved(tiny, tmp_path / "s")
    with store:
        row = store.index.by_name("default", "s")
        assert row is not None
        block = [b.blob for b in store.index.blocks(row.id)][which]
        path = store.blobs.path(block)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10  # inside the last tensor's bytes: only its checksum can tell
        path.write_bytes(bytes(data))
        before = open_fds()
        with pytest.raises(persist.CorruptBlobError, match=block):
            store.restore("s", identity=identity)
        assert open_fds() == before  # every worker closed its blob
        path.write_bytes(bytes(data[:-5] + bytes([data[-5] ^ 0x10]) + data[-4:]))
        assert live_state(store.restore("s", identity=identity).cache) == live_state(cache)


def test_progress_is_reported_on_the_calling_thread_in_order(tiny: Any, tmp_path: Path) -> None:
    store, identity, _ = saved(tiny, tmp_path / "s")
    calls: list[tuple[int, int, int]] = []
    with store:
        n = store.index.by_name("default", "s").n_blocks + 1  # type: ignore[union-attr]
        store.restore(
            "s",
            identity=identity,
            progress=lambda done, total: calls.append((done, total, threading.get_ident())),
        )
    assert [(d, t) for d, t, _ in calls] == [(i, n) for i in range(1, n + 1)]
    assert {who for _, _, who in calls} == {threading.get_ident()}


def test_restores_on_other_threads_get_their_own_streams(tiny: Any, tmp_path: Path) -> None:
    store, identity, cache = saved(tiny, tmp_path / "s")
    want, got, errors = live_state(cache), [], []

    def restore() -> None:
        try:
            got.append(live_state(store.restore("s", identity=identity).cache))
        except BaseException as e:  # MLX streams are per thread: a shared one fails here
            errors.append(e)

    with store:
        restore()
        threads = [threading.Thread(target=restore) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert got == [want] * 3


def test_restores_on_many_short_lived_threads_leak_no_threads(tiny: Any, tmp_path: Path) -> None:
    """MLX never frees a stream's OS thread (nor the default stream each Python
    thread gets): persist's fill streams go to a few threads only."""
    store, identity, cache = saved(tiny, tmp_path / "s", n=40)
    want, errors = live_state(cache), []

    def restore() -> None:
        try:
            assert live_state(store.restore("s", identity=identity).cache) == want
        except BaseException as e:
            errors.append(e)

    n = tensors.STREAM_THREADS + 4

    def batch() -> int:
        for _ in range(n):
            t = threading.Thread(target=restore)
            t.start()
            t.join()
        return len(os.listdir("/proc/self/task"))

    with store:
        first = batch()  # uses up whatever is left of the budget
        # MLX's own default stream per thread (and room for a stray thread of
        # another test), not persist's two fill streams more per thread
        assert batch() - first <= n + n // 2, "every restoring thread left fill streams behind"
    assert not errors, errors


def test_a_header_seen_before_is_not_parsed_again(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing a blob's 64 header entries cost about 0.5 ms of Python a blob on the
    H200's restore, under the GIL its readers wait for: a header whose bytes hash to
    one already checked reuses that parse."""
    store, identity, cache = saved(tiny, tmp_path / "s")
    parsed: list[str] = []
    real = blob_reads.parse_header

    def counted(head: bytes, size: int, where: str) -> Any:
        parsed.append(where)
        return real(head, size, where)

    monkeypatch.setattr(blob_reads, "parse_header", counted)
    monkeypatch.setattr(blob_reads, "_checked", OrderedDict())
    with store:
        first = store.restore("s", identity=identity).cache
        blobs = len(parsed)
        assert blobs > 2 * loading.WORKERS
        again = store.restore("s", identity=identity).cache
        assert len(parsed) == blobs  # none parsed twice
    assert live_state(again) == live_state(first) == live_state(cache)


@pytest.mark.parametrize("damage", ["header byte", "longer file", "shorter header"])
def test_a_header_changed_after_it_was_seen_is_refused(
    damage: str, tiny: Any, tmp_path: Path
) -> None:
    """The parse is reused only for the very bytes it came from: a header edited in
    place (same length), a file grown, or a header length changed is read again and
    refused against the index, never served from the earlier parse."""
    store, identity, cache = saved(tiny, tmp_path / "s")
    with store:
        store.restore("s", identity=identity)  # every header now seen
        row = store.index.by_name("default", "s")
        assert row is not None
        block = [b.blob for b in store.index.blocks(row.id)][3]
        path = store.blobs.path(block)
        good = path.read_bytes()
        data = bytearray(good)
        if damage == "header byte":
            at = data.index(b'"shape"') + 1
            data[at] ^= 0x20  # "shape" -> "Shape": the same length
        elif damage == "longer file":
            data += b"\0" * 8
        else:
            data[0] ^= 0x08  # the length prefix
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(persist.CorruptBlobError, match=block):
            store.restore("s", identity=identity)
        path.write_bytes(good)
        assert live_state(store.restore("s", identity=identity).cache) == live_state(cache)


def test_the_headers_kept_are_bounded(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, identity, cache = saved(tiny, tmp_path / "s")
    monkeypatch.setattr(blob_reads, "SEEN_HEADERS", 3)
    monkeypatch.setattr(blob_reads, "_checked", OrderedDict())
    with store:
        for _ in range(2):
            assert live_state(store.restore("s", identity=identity).cache) == live_state(cache)
            assert len(blob_reads._checked) == 3
