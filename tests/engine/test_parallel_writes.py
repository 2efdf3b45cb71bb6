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


def test_a_ctrl_c_while_the_writes_finish_leaves_nothing(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside attack r15, F1: a save waits longest for its last writes (their fsyncs),
    so that is where a Ctrl-C lands.  It ended the wait, the save's clean-up removed
    the blobs listed so far, and the writes still running renamed theirs into place
    after it: orphan blobs (on an empty store, check said the index was lost).
    Three blobs, fewer than the writers hold, so the save's only wait is the last."""
    import os
    import signal
    import sys

    store, identity, _, _ = setup(tiny, tmp_path / "s")
    model, _, _ = tiny("llama")
    toks = tokens_for(2 * BLOCK + 5, seed=62)
    cache = prefill(model, toks)[0]
    before = blob_files(store)
    real, release, interrupted = FileBlobs.put, threading.Event(), threading.Event()

    def put(self: FileBlobs, *a: Any, **k: Any) -> Any:
        assert release.wait(30)  # a slow disk: the save's thread waits for this write
        return real(self, *a, **k)

    def ctrl_c(signum: int, frame: Any) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    main = threading.main_thread().ident
    assert main is not None

    def press_ctrl_c_in_the_last_wait() -> None:
        for _ in range(3000):
            frame = sys._current_frames().get(main)
            while frame is not None and not (
                frame.f_code.co_name == "close"
                and frame.f_code.co_filename.endswith("blob_writes.py")
            ):
                frame = frame.f_back
            if frame is not None:
                os.kill(os.getpid(), signal.SIGINT)
                interrupted.wait(30)
                break
            time.sleep(0.01)
        release.set()  # the writes finish after the interrupt, as a slow disk's would

    monkeypatch.setattr(FileBlobs, "put", put)
    old = signal.signal(signal.SIGINT, ctrl_c)
    presser = threading.Thread(target=press_ctrl_c_in_the_last_wait)
    try:
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            store.save(cache, toks, identity=identity, session="new")
    finally:
        presser.join(60)
        signal.signal(signal.SIGINT, old)
    assert interrupted.is_set()
    for t in threading.enumerate():  # any write still running ends before we look
        if t.name.startswith("persist-write"):
            t.join(30)
    monkeypatch.undo()
    assert blob_files(store) == before  # every blob the save wrote is gone
    assert [s.session for s in store.sessions()] == ["kept"]
    assert store.check() == []
    store.close()


def test_a_ctrl_c_inside_the_hand_over_of_a_write_leaves_nothing(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside attack r15, F1 again: a Ctrl-C landing in ``submit`` as it starts a writer
    thread (the write already queued) lost the write's future: it ran, renamed its blob
    into place, and no one listed it for the clean-up (5 of 150 saves under SIGINTs)."""
    from concurrent.futures import ThreadPoolExecutor

    store, identity, cache, toks = setup(tiny, tmp_path / "s")
    before = blob_files(store)
    pressed = []

    class Interrupted(ThreadPoolExecutor):
        def _adjust_thread_count(self) -> None:
            super()._adjust_thread_count()
            if self._thread_name_prefix == "persist-write" and not pressed:
                pressed.append(1)
                raise KeyboardInterrupt  # as the thread started: the write is queued

    monkeypatch.setattr(blob_writes, "ThreadPoolExecutor", Interrupted)
    with store:
        with pytest.raises(KeyboardInterrupt):
            store.save(cache, toks, identity=identity, session="new")
        assert pressed
        assert blob_files(store) == before
        assert store.check() == []
