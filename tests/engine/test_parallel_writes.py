"""A save writes its blobs on two threads: still all-or-nothing, whatever fails where."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.engine import blob_writes
from persist.storage.blobs import FileBlobs
from tests.helpers import live_state, prefill, tokens_for
from tests.store_helpers import clean

BLOCK = 16  # 300 tokens: 18 blocks and a tail, more than the writers hold at once


def blob_files(store: persist.Store) -> set[str]:
    return {p.name for p in (store.root / "blobs").rglob("*.safetensors")}


def setup(tiny: Any, root: Path) -> tuple[persist.Store, persist.ModelIdentity, Any, list[int]]:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    store = persist.Store(root, block_tokens=BLOCK)
    kept = tokens_for(100, seed=60)
    store.save(prefill(model, kept)[0], kept, identity=identity, session="kept")
    toks = tokens_for(300, seed=61)
    return store, identity, prefill(model, toks)[0], toks


@pytest.mark.parametrize("fail_at", [0, 5, 18])
def test_a_write_failing_beside_others_leaves_nothing(
    fail_at: int, tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, identity, cache, toks = setup(tiny, tmp_path / "s")
    before = blob_files(store)
    real, calls, lock = FileBlobs.put, [0], threading.Lock()

    def put(self: FileBlobs, *a: Any, **k: Any) -> Any:
        with lock:
            n, calls[0] = calls[0], calls[0] + 1
        if n == fail_at:
            raise OSError(errno.EIO, "injected write error")
        return real(self, *a, **k)

    monkeypatch.setattr(FileBlobs, "put", put)
    with store, pytest.raises(OSError, match="injected"):
        store.save(cache, toks, identity=identity, session="new")
    monkeypatch.undo()
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as again:
        assert blob_files(again) == before  # every blob written beside it was removed
        assert [s.session for s in again.sessions()] == ["kept"]
        clean(again)


def test_an_interrupt_between_writes_leaves_nothing(tiny: Any, tmp_path: Path) -> None:
    store, identity, cache, toks = setup(tiny, tmp_path / "s")
    before = blob_files(store)

    def progress(done: int, total: int) -> None:
        if done == 7:  # blocks still being written on the writer threads
            raise KeyboardInterrupt

    with store:
        with pytest.raises(KeyboardInterrupt):
            store.save(cache, toks, identity=identity, session="new", progress=progress)
        assert blob_files(store) == before
        clean(store)
        info = store.save(cache, toks, identity=identity, session="new")
        assert info.tokens == len(toks)
        assert live_state(store.restore("new", identity=identity).cache) == live_state(cache)


def test_bytes_already_being_written_by_this_save_are_not_written_twice(tmp_path: Path) -> None:
    blobs, started, release = FileBlobs(tmp_path), threading.Event(), threading.Event()

    def write(sink: Any) -> bytes:
        started.set()
        release.wait(10)
        sink.write(b"x" * 10)
        return b""

    written: list[Any] = []
    writes = blob_writes._Writes(blobs, "0123456789ab", written)
    file = writes.start("a" * 32, write, 10)
    assert started.wait(10)
    assert writes.find("a" * 32) == file  # still being written: the same file
    assert writes.find("b" * 32) is None
    release.set()
    writes.close()
    assert [b.file for b in written] == [file] and blobs.exists(file)
    assert writes.find("a" * 32) == file  # and once written


def test_a_paused_save_hashes_only_a_few_blocks_ahead(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``persist serve``'s write-behind pauses between blocks while a request prompts
    (``yielding.pause``); the hashing must pause with it, not run a whole cache's
    blocks beside the prefill (it was ``pool.map``: every block submitted at once)."""
    store, identity, cache, toks = setup(tiny, tmp_path / "s")
    hashed: list[int] = []
    real = blob_writes.materialize
    seen_at_pause: list[int] = []

    def counting(pieces: Any) -> Any:
        hashed.append(1)
        return real(pieces)

    monkeypatch.setattr(blob_writes, "materialize", counting)

    def paused() -> None:  # a request prompting: the hashers get time to run ahead
        time.sleep(0.02)
        seen_at_pause.append(len(hashed))

    monkeypatch.setattr(blob_writes, "pause", paused)
    store.save(cache, toks, identity=identity, session="s")
    blocks = len(toks) // BLOCK
    assert len(seen_at_pause) == blocks and sum(hashed) == blocks + 1  # and the tail
    for taken, at_pause in enumerate(seen_at_pause):
        assert at_pause <= taken + blob_writes.AHEAD  # never further ahead than that
    assert seen_at_pause[0] <= blob_writes.AHEAD < blocks
    store.close()
