"""The staged restore (cuda/pinned + engine/staged/restore): blobs through lanes of
staging slots straight into the tensors' own buffers, against the host path,
bit for bit.

On CUDA the lanes are the real ones (page-locked slots, the copy engine on a
stream per lane, device buffers from the zeroing kernel), plus lanes of tiny
real slots so that tensors span slots; elsewhere lanes of plain host slots
whose copies are ``memmove`` into MLX's host buffers run the same pipeline
(threads, hashing, slot reuse, strided placement, partial rooms).  The
selection and its fallbacks are tested on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import persist
from persist.cuda import pinned
from persist.cuda import readers as readers_mod
from persist.cuda.pinned import CUDA_PINNED, HOST, Choice, Placed, Ring
from persist.cuda.readers import Readers
from persist.engine.staged import restore as staging
from persist.engine.staged import slot_reads
from persist.errors import CorruptBlobError
from tests.helpers import (
    CUDA_RTOL,
    ON_CUDA,
    assert_same_state,
    continue_run,
    live_state,
    persist_cli,
    prefill,
    raw,
    tokens_for,
)
from tests.host_lanes import HostLane, host_buffers, host_ring, host_scatter, staged
from tests.store_helpers import full_then_trim, whole_buffers

BLOCK = 16
FAMILIES = ["llama", "gemma3", "qwen3_next", "mamba2", "falcon_h1", "llama4"]


def small_ring(processes: bool = False) -> Ring:
    """Slots far smaller than a tensor run: every tensor spans slots."""
    if ON_CUDA:
        return pinned._cuda_ring(pinned.Driver(), 3, 1024, processes=processes)
    return proc_ring(3, 1024) if processes else host_ring(3, 1024)


class HostProcLane(HostLane):
    """A host lane whose slots a reader process fills (cuda/readers)."""

    def __init__(self, readers: Readers, i: int) -> None:
        super().__init__(0)
        self.slots, self.readers, self.i = readers.slots[i], readers, i
        self.send = functools.partial(readers.send, i)
        self.answer = readers.answer

    def enter(self) -> None:
        self.readers.ready(self.i)


def proc_ring(lanes: int, size: int) -> Ring:
    readers = Readers(lanes, size)
    made: list[Any] = [HostProcLane(readers, i) for i in range(lanes)]
    return Ring(made, host_buffers, host_scatter, readers)


@pytest.fixture(scope="module")
def rings() -> Iterator[dict[str, Ring]]:
    out = {"small": small_ring(), "small processes": small_ring(processes=True)}
    if ON_CUDA:
        chosen = pinned.data_path()
        assert chosen.path == CUDA_PINNED, chosen.reason
        assert chosen.ring is not None and chosen.ring.readers is not None
        out["default"] = chosen.ring
        out["threads"] = pinned._cuda_ring(pinned.Driver(), pinned.LANES, 64 << 10)
        # both ways to the tensors: straight from the slots, and through staging
        out["direct"] = pinned._cuda_ring(pinned.Driver(), 3, 1024, straight=True)
        out["staged"] = pinned._cuda_ring(pinned.Driver(), 3, 1024, straight=False)
    else:
        out["default"] = proc_ring(pinned.LANES, 64 << 10)
        out["threads"] = host_ring(pinned.LANES, 64 << 10)
        out["direct"] = host_ring(3, 1024, direct=True)
        out["staged"] = host_ring(3, 1024)
    out["pieces"] = out["threads"]  # read in pieces of one tensor (see ring_for)
    yield out
    for ring in out.values():
        if ring.readers is not None:
            ring.readers.close()


@pytest.fixture
def ring_for(rings: dict[str, Ring], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The ring of a name; "pieces" reads and hashes each tensor alone inside a
    slot (staging.PIECE of one byte), so slots hold several hashed pieces."""

    def get(name: str) -> Ring:
        if name == "pieces":
            monkeypatch.setattr(slot_reads, "PIECE", 1)
        return rings[name]

    return get


def host() -> Any:
    return pinned.use(Choice(HOST, "test"))


def all_free(ring: Ring) -> bool:
    """No restore holds the ring (its lock is free)."""
    if ring.lock.acquire(blocking=False):
        ring.lock.release()
        return True
    return False


RINGS = ["default", "threads", "small", "small processes", "pieces", "direct", "staged"]


@pytest.mark.parametrize("ring_name", RINGS)
@pytest.mark.parametrize("variant", FAMILIES)
def test_a_staged_restore_is_the_host_restore(
    variant: str, ring_name: str, ring_for: Any, tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny(variant)
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(70, seed=11)
    cache, _ = prefill(model, prompt, step=30)
    ring = ring_for(ring_name)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(cache, prompt, identity=ident, session="s")
        with host():
            by_host = store.restore("s", identity=ident).cache
        with staged(ring):
            by_ring = store.restore("s", identity=ident).cache
    assert all_free(ring)
    assert_same_state(live_state(by_ring), live_state(cache))
    assert_same_state(live_state(by_ring), live_state(by_host))
    assert whole_buffers(by_ring) == whole_buffers(by_host)  # the same room, zeroed
    nxt = [5, 77, 3]
    a, _ = continue_run(model, by_ring, nxt, n_greedy=2)
    b, _ = continue_run(model, by_host, nxt, n_greedy=2)
    for x, y in zip(a, b, strict=True):
        if ON_CUDA:  # see tests/helpers.CUDA_RTOL
            scale = mx.maximum(mx.abs(y).max(), 1.0)
            assert (mx.abs(x - y).max() <= CUDA_RTOL * scale).item()
        else:
            assert raw(x) == raw(y)
    assert_same_state(live_state(by_ring), live_state(by_host))


@pytest.mark.parametrize("ring_name", RINGS)
@pytest.mark.parametrize("n,k", [(200, 40), (200, 48), (70, 67)])
def test_a_staged_partial_hit_is_a_full_restore_trimmed(
    n: int, k: int, ring_name: str, ring_for: Any, tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    stored = tokens_for(n, seed=3)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(prefill(model, stored)[0], stored, identity=ident, session="s")
        prompt = stored[:k] + [(stored[k] + 1) % 256, 5]
        with staged(ring_for(ring_name)):
            hit = store.lookup(prompt, identity=ident)
        with host():
            trimmed = full_then_trim(store, "s", ident, k)
    assert hit is not None and len(hit.tokens) == k
    assert_same_state(live_state(hit.cache), live_state(trimmed))
    assert whole_buffers(hit.cache) == whole_buffers(trimmed)


@pytest.mark.parametrize(
    "ring_name,at",
    [
        ("small", -5),
        ("pieces", -5),
        ("pieces", "middle"),
        ("small processes", -5),
        ("small processes", "middle"),  # the next slot's request already sent: drained
        ("default", "middle"),
        ("default", -5),
        ("direct", "middle"),
        ("direct", -5),
    ],
)
def test_a_damaged_tensor_is_refused_and_the_ring_recovers(
    ring_name: str, at: Any, ring_for: Any, tiny: Any, tmp_path: Path, caplog: Any
) -> None:
    """Refused; and with reader processes, the request already sent for the next
    slot is answered before the error goes up, so the next restore's replies are
    its own (no worker lost, no restore sent to the host path)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(100, seed=2)
    cache = prefill(model, prompt)[0]
    ring = ring_for(ring_name)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        info = store.save(cache, prompt, identity=ident, session="s")
        block = store.index.blocks(info.id)[2].blob
        assert block is not None
        path = store.blobs.path(block)
        good = path.read_bytes()
        data = bytearray(good)
        # inside the last tensor's bytes, or one in the middle of a slot's pieces
        data[-5 if at == -5 else len(data) * 2 // 3] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with staged(ring), pytest.raises(CorruptBlobError, match="checksum mismatch"):
            store.restore("s", identity=ident)
        assert all_free(ring)
        path.write_bytes(good)  # mended: the next restore through the ring works
        with staged(ring), caplog.at_level(logging.WARNING, logger="persist"):
            again = store.restore("s", identity=ident).cache
    assert_same_state(live_state(again), live_state(cache))
    assert all_free(ring)
    assert not [r for r in caplog.records if "host path" in r.getMessage()]


def test_stats_report_the_path_taken(rings: dict[str, Ring], tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(20, seed=1)
    with persist.Store(tmp_path / "s") as store:
        store.save(prefill(model, prompt)[0], prompt, identity=ident, session="s")
        assert store.stats().data_paths == {}
        with host():
            store.restore("s", identity=ident)
        (path,) = store.stats().data_paths.values()
        assert path == "host (test)"
        with staged(rings["small"]):
            store.restore("s", identity=ident)
        assert list(store.stats().data_paths.values()) == ["cuda-pinned (test ring)"]
    out = persist_cli(tmp_path, "stats", "--store", str(tmp_path / "s")).stdout
    assert out.splitlines()[-1].startswith("data path ")
    assert out.splitlines()[-1].endswith(f"/{pinned.backend()}: cuda-pinned (test ring)")


# -- the selection, made once per process (CPU: every fallback) ---------------------


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(pinned, "_choice", None)
    monkeypatch.delenv("PERSIST_DATA_PATH", raising=False)
    yield


@pytest.mark.skipif(ON_CUDA, reason="the CPU's choice")
def test_on_the_cpu_the_host_path_is_chosen_once(fresh_choice: None) -> None:
    first = pinned.data_path()
    assert first.path == HOST and first.ring is None
    assert "MLX runs on cpu" in first.reason
    assert pinned.data_path() is first


def test_the_host_path_can_be_asked_for(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSIST_DATA_PATH", "host")
    assert pinned.data_path() == Choice(HOST, "PERSIST_DATA_PATH=host")


def test_without_the_driver_library_the_host_path_is_taken(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "backend", lambda: "cuda")

    def no_lib(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    got = pinned.data_path()
    assert got.path == HOST and got.ring is None
    assert "CUDA driver API unavailable (libcuda.so.1: cannot open" in got.reason


class FakeDriver:
    """The driver's answers without a GPU: host_alloc from numpy, or refused."""

    batched = False  # no batched copies

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.keep: list[np.ndarray] = []

    def prove_batch(self) -> bool:
        return False

    def host_alloc(self, n: int) -> tuple[int, int]:
        if self.refuse:
            raise MemoryError(f"cuMemHostAlloc of {n} bytes returned CUDA error 2")
        buf = np.zeros(n, dtype=np.uint8)
        self.keep.append(buf)
        return buf.ctypes.data, buf.ctypes.data

    def host_register(self, host: int, n: int) -> None:
        if self.refuse:
            raise MemoryError(f"cuMemHostRegister of {n} bytes returned CUDA error 2")
        self.registered = (host, n)

    def stream(self) -> int:
        return len(self.keep)

    def event(self) -> int:
        return len(self.keep)


def test_a_refused_pinned_allocation_falls_back(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "backend", lambda: "cuda")
    monkeypatch.setattr(pinned, "Driver", lambda: FakeDriver(refuse=True))
    got = pinned.data_path()
    assert got.path == HOST
    assert got.reason.startswith("pinned host memory refused (cuMemHostAlloc of")


def test_with_driver_and_memory_the_ring_is_made_once(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "backend", lambda: "cuda")
    made: list[FakeDriver] = []

    def driver() -> FakeDriver:
        made.append(FakeDriver(refuse=False))
        return made[-1]

    monkeypatch.setattr(pinned, "Driver", driver)
    monkeypatch.setenv("PERSIST_READERS", "threads")
    got = pinned.data_path()
    assert got.path == CUDA_PINNED and got.ring is not None and got.ring.readers is None
    assert len(got.ring.lanes) == pinned.LANES and "8 reader threads" in got.reason
    assert got.ring.slot_bytes == pinned.SLOT_BYTES
    got.ring.lanes[1].slots[1][:4] = 7  # the slots are the driver's memory
    assert made[0].keep[3][:4].tolist() == [7, 7, 7, 7]
    assert pinned.data_path() is got and len(made) == 1


def test_by_default_reader_processes_fill_the_lanes(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their slots are one shared mapping, page-locked whole by the driver."""
    monkeypatch.setattr(pinned, "backend", lambda: "cuda")
    made = FakeDriver(refuse=False)
    monkeypatch.setattr(pinned, "Driver", lambda: made)
    monkeypatch.delenv("PERSIST_READERS", raising=False)
    got = pinned.data_path()
    ring = got.ring
    assert got.path == CUDA_PINNED and ring is not None and ring.readers is not None
    try:
        assert "8 reader processes" in got.reason
        assert made.registered == (ring.readers.base, 2 * pinned.LANES * pinned.SLOT_BYTES)
        assert not made.keep  # no slot of cuMemHostAlloc's
        assert ring.lanes[7].slots[1].ctypes.data == ring.readers.base + 15 * pinned.SLOT_BYTES
    finally:
        ring.readers.close()


# -- placement: where a piece's bytes go, whatever slots cut it into ------------


@st.composite
def pieces(draw: st.DrawFn) -> tuple[Any, ...]:
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    t, d = draw(st.integers(0, 5)), draw(st.integers(1, 4))
    item = draw(st.sampled_from([1, 2, 4]))
    at = draw(st.integers(0, 4))
    cap = at + t + draw(st.integers(0, 3))
    limit = draw(st.one_of(st.none(), st.integers(0, cap + 1)))
    stored = (*lead, t, d)
    size = int(np.prod(stored)) * item
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=6)))
    return stored, len(lead), item, at, cap, limit, cuts


@given(pieces())
@settings(max_examples=300, deadline=None)
def test_placement_puts_each_kept_byte_where_the_host_path_does(case: tuple[Any, ...]) -> None:
    stored, axis, item, at, cap, limit, cuts = case
    alloc = (*stored[:axis], cap, *stored[axis + 1 :])
    src = np.random.default_rng(0).integers(1, 255, int(np.prod(stored)) * item, dtype=np.uint8)
    out = np.zeros(int(np.prod(alloc)) * item, dtype=np.uint8)
    g = staging.geometry(stored, at, staging.Dest(out.ctypes.data, alloc, axis, limit, item))
    bounds = [0, *cuts, src.nbytes]
    for a, b in itertools.pairwise(bounds):  # each cut: a slot of its own
        slot = src[a:b].copy()
        for c in staging.placement(Placed(0, a, b, *g)):
            assert c.width <= c.spitch and c.src + (c.height - 1) * c.spitch + c.width <= b - a
            for r in range(c.height):
                ctypes.memmove(
                    c.dst + r * c.dpitch, slot.ctypes.data + c.src + r * c.spitch, c.width
                )
    want = np.zeros((*alloc[:axis], cap, stored[axis + 1] * item), dtype=np.uint8)
    end = cap if limit is None else min(limit, cap)
    keep = max(0, min(stored[axis], end - at))
    lay = src.reshape(*stored[:axis], stored[axis], stored[axis + 1] * item)
    want[..., at : at + keep, :] = lay[..., :keep, :]
    assert out.tobytes() == want.tobytes()


def test_a_staged_restore_goes_through_the_lanes(tiny: Any, tmp_path: Path) -> None:
    """The ring's lanes did the copies: slots taken, strided copies made (a test
    of the test: the staged restores above are not the host path's)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(70, seed=5)
    ring = host_ring(2, 1024) if not ON_CUDA else None
    if ring is None:
        pytest.skip("the host lanes' counters")
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(prefill(model, prompt)[0], prompt, identity=ident, session="s")
        with staged(ring):
            store.restore("s", identity=ident)
    lanes = [lane for lane in ring.lanes if isinstance(lane, HostLane)]
    assert sum(lane.taken for lane in lanes) > 2 and sum(lane.copies for lane in lanes) > 2


def test_staging_buffers_of_many_chunks_hold_every_slot(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore larger than one staging buffer (CHUNK) spreads its slots over
    several; none straddles two, and the scatter of each puts every piece in place."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(90, seed=9)
    cache = prefill(model, prompt)[0]
    made: list[list[int]] = []  # each call's sizes: the tensors', then the staging chunks
    ring = small_ring()
    buffers = ring.buffers
    ring.buffers = lambda sizes: made.append(sizes) or buffers(sizes)  # type: ignore[method-assign]
    monkeypatch.setattr(staging, "CHUNK", 3 * ring.slot_bytes)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(cache, prompt, identity=ident, session="s")
        with staged(ring):
            got = store.restore("s", identity=ident).cache
    chunks = made[1]
    assert len(chunks) > 2 and max(chunks) <= 3 * ring.slot_bytes
    assert_same_state(live_state(got), live_state(cache))


def _forge_shape(store: persist.Store, block: str) -> None:
    """Give a tensor of ``block`` other leading dimensions in its header (same bytes,
    same checksum, header and size kept consistent with the index)."""
    import json
    import sqlite3
    import struct

    from persist.format.container import checksum

    path = store.blobs.path(block)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    hdr = json.loads(data[8 : 8 + n])
    key = next(k for k in hdr if k != "__metadata__" and len(hdr[k]["shape"]) == 4)
    b, h, t, e = hdr[key]["shape"]
    hdr[key]["shape"] = [b * 8, h, t // 8, e]  # the same bytes as 8x the rows
    text = json.dumps(hdr, separators=(",", ":")).encode()
    data[8 : 8 + n] = text + b" " * (n - len(text))
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    db = sqlite3.connect(store.root / "index.sqlite")
    db.execute(
        "UPDATE blobs SET head_xxh3 = ?, size = ? WHERE file = ?",
        [checksum(bytes(data[: 8 + n])), len(data), block],
    )
    db.commit()
    db.close()


@pytest.mark.parametrize("path", ["staged", "host"])
def test_a_header_shape_that_does_not_fit_is_refused(path: str, tiny: Any, tmp_path: Path) -> None:
    """Attack 27 (round 4): a header's shape is never trusted to place bytes (the
    staged path wrote rows past the tensor's buffer)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=9)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        info = store.save(prefill(model, toks)[0], toks, identity=ident, session="s")
        _forge_shape(store, store.index.blocks(info.id)[0].blob)
    way = staged(host_ring(3, 64 << 10)) if path == "staged" else host()
    with persist.Store(tmp_path / "s") as store, way, pytest.raises(CorruptBlobError):
        store.restore("s", identity=ident)


def test_a_progress_callback_may_restore_again(tiny: Any, tmp_path: Path) -> None:
    """Attack 27 (round 4): a progress callback that restores through the same store
    deadlocked on the staged path (the ring's lock); it now takes the host path."""
    import threading

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(100, seed=4)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="s")
        store.save(prefill(model, toks[:30])[0], toks[:30], identity=ident, session="other")
        inner: list[Any] = []

        def progress(done: int, total: int) -> None:
            if not inner:
                inner.append(store.restore("other", identity=ident).cache)

        out: list[Any] = []

        def go() -> None:
            with staged(host_ring(3, 1000)):
                out.append(store.restore("s", identity=ident, progress=progress).cache)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(120)  # a hang detector, not a timing verdict
        assert not t.is_alive(), "the nested restore deadlocked"
    assert out and inner


def test_a_second_interrupt_still_waits_for_the_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack 27 (round 4): a second Ctrl-C during the cleanup released the ring while
    readers still used its lanes; the cleanup now finishes, then raises."""
    calls: list[str] = []

    def waited(futures: Any) -> None:
        calls.append("wait")
        if len(calls) == 1:
            raise KeyboardInterrupt  # the second Ctrl-C, inside the wait

    class Drained:
        def drain(self) -> None:
            calls.append("drain")

    monkeypatch.setattr(pinned, "wait", waited)
    with pytest.raises(KeyboardInterrupt):
        pinned.settle([], Drained())  # type: ignore[arg-type]
    assert calls == ["wait", "wait", "drain"]


def test_the_ring_keeps_its_reader_threads(tiny: Any, tmp_path: Path) -> None:
    """One thread per lane, started with the ring's first restore and reused by the
    next ones (started per restore, they reached their first read up to 16 ms late)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(100, seed=6)
    cache = prefill(model, prompt)[0]
    ring = host_ring(3, 1024)
    seen: list[set[int]] = []
    read = staging._lane

    def job(*a: Any) -> None:
        seen[-1].add(threading.get_ident())
        read(*a)

    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(cache, prompt, identity=ident, session="s")
        with staged(ring), pytest.MonkeyPatch.context() as mp:
            mp.setattr(staging, "_lane", job)
            for _ in range(3):
                seen.append(set())
                got = store.restore("s", identity=ident).cache
                assert_same_state(live_state(got), live_state(cache))
    pool = ring.pool()
    assert len(pool._threads) == 3 and set.union(*seen) <= {t.ident for t in pool._threads}


# -- reader processes (cuda/readers) ------------------------------------------


def _pids(ring: Ring) -> list[int]:
    assert ring.readers is not None
    return [p.pid for p in ring.readers._procs if p is not None]


def test_reader_processes_never_load_mlx(rings: dict[str, Ring]) -> None:
    """A worker is stdlib and xxhash: no second MLX (nor CUDA context) per lane."""
    for pid in _pids(rings["default"]):
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "xxhash" in maps and "mlx" not in maps.lower()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_a_reader_process_killed_or_interrupted(
    how: signal.Signals,
    tiny: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SIGKILL: that restore reads on the host path (same state), the next one
    starts a new worker.  SIGINT (a terminal's Ctrl-C reaches the whole group):
    ignored, the parent decides."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(100, seed=4)
    cache = prefill(model, prompt)[0]
    ring = small_ring(processes=True)
    try:
        with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
            store.save(cache, prompt, identity=ident, session="s")
            before = _pids(ring)
            for pid in before:
                os.kill(pid, how)
            readers = ring.readers
            assert readers is not None
            if how == signal.SIGKILL:
                for p in readers._procs:
                    assert p is not None and p.wait(timeout=10) == -signal.SIGKILL
                # as if they died after the restore began: not restarted at its start
                monkeypatch.setattr(readers, "ready", lambda i: None)
            with staged(ring), caplog.at_level(logging.WARNING, logger="persist"):
                first = store.restore("s", identity=ident).cache
                monkeypatch.undo()
                second = store.restore("s", identity=ident).cache
            lost = [r for r in caplog.records if "reads on the host path" in r.getMessage()]
            assert len(lost) == (how == signal.SIGKILL)
        after = _pids(ring)
        assert (set(after).isdisjoint(before)) == (how == signal.SIGKILL)
        assert all(p is not None and p.poll() is None for p in ring.readers._procs)  # type: ignore[union-attr]
        for got in (first, second):
            assert_same_state(live_state(got), live_state(cache))
        assert all_free(ring)
    finally:
        assert ring.readers is not None
        ring.readers.close()


def test_requests_longer_than_a_message_are_split(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slots holding more tensors than one message names go as several requests
    that cover the slot back to back; a damaged tensor in a later one is found."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(100, seed=8)
    cache = prefill(model, prompt)[0]
    monkeypatch.setattr(readers_mod, "MAX_MESSAGE", 400)
    sent: list[int] = []
    requests = readers_mod._requests
    monkeypatch.setattr(
        readers_mod, "_requests", lambda pieces, n: sent.append(n) or requests(pieces, n)
    )
    ring = proc_ring(2, 1 << 20)
    try:
        with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
            info = store.save(cache, prompt, identity=ident, session="s")
            with staged(ring):
                got = store.restore("s", identity=ident).cache
            assert_same_state(live_state(got), live_state(cache))
            many = [len(requests(p, 1)) for p in [[_fake_piece(i) for i in range(40)]]]
            assert many[0] > 2
            path = store.blobs.path(store.index.blocks(info.id)[1].blob or "")
            data = bytearray(path.read_bytes())
            data[-3] ^= 1
            path.chmod(0o644)
            path.write_bytes(bytes(data))
            with staged(ring), pytest.raises(CorruptBlobError, match="checksum mismatch"):
                store.restore("s", identity=ident)
        assert sent and all_free(ring)
    finally:
        assert ring.readers is not None
        ring.readers.close()


def _fake_piece(i: int) -> readers_mod.Piece:
    return readers_mod.Piece(
        a=i, b=i + 1, ident=i, first=True, last=True, digest=bytes(16), where="t"
    )


def _saved(tiny: Any, tmp_path: Path, n: int = 100) -> tuple[persist.Store, Any, Any, int]:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(n, seed=12)
    cache = prefill(model, prompt)[0]
    store = persist.Store(tmp_path / "s", block_tokens=BLOCK)
    info = store.save(cache, prompt, identity=ident, session="s")
    return store, ident, cache, info.id


def test_a_stopped_worker_times_out_and_is_replaced(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack (round 4, session 2): a SIGSTOPped worker hung the restore forever
    (and with it the ring).  Its request now times out: the worker is killed, the
    restore reads on the host path, the next one starts a new worker, and later
    replies stay in step (a damaged blob is still refused, good ones still pass)."""
    monkeypatch.setattr(readers_mod, "REPLY_SECONDS", 1.0)
    store, ident, cache, snapshot = _saved(tiny, tmp_path)
    ring = proc_ring(1, 1024)
    try:
        assert ring.readers is not None
        stopped = _pids(ring)[0]
        os.kill(stopped, signal.SIGSTOP)
        out: list[Any] = []

        def go() -> None:
            with staged(ring):
                out.append(store.restore("s", identity=ident).cache)
                out.append(store.restore("s", identity=ident).cache)

        with caplog.at_level(logging.WARNING, logger="persist"):
            t = threading.Thread(target=go, daemon=True)
            t.start()
            t.join(120)  # a hang detector, not a timing verdict
        assert not t.is_alive(), "the restore waits on a stopped worker"
        assert any("timed out" in r.getMessage() for r in caplog.records)
        assert _pids(ring) and _pids(ring)[0] != stopped
        for got in out:
            assert_same_state(live_state(got), live_state(cache))
        with staged(ring):
            _damage_block(store, snapshot, 1)
            with pytest.raises(CorruptBlobError, match="checksum mismatch"):
                store.restore("s", identity=ident)
    finally:
        assert ring.readers is not None
        ring.readers.close()
        store.close()


def _damage_block(store: persist.Store, snapshot: int, block: int) -> None:
    path = store.blobs.path(store.index.blocks(snapshot)[block].blob or "")
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_a_reply_out_of_step_is_never_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack (round 4, session 2): after a late reply, every later reply answered
    the request before it, and restores came back wrong without an error.  Each
    reply names its request; one that names another kills the worker."""
    readers = Readers(1, 1024)
    try:
        readers._kill(0)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sleeper = subprocess.Popen(["sleep", "60"])
        readers._socks[0], readers._procs[0] = ours, sleeper  # type: ignore[call-overload]

        def stale_worker() -> None:
            msg, fds, _, _ = socket.recv_fds(theirs, 1 << 16, 1)
            for f in fds:
                os.close(f)
            seq = int(msg.split(b",")[0])
            theirs.send(f"{seq - 1} ok".encode())  # the answer to the request before

        t = threading.Thread(target=stale_worker)
        t.start()
        with open(__file__, "rb") as f, pytest.raises(readers_mod.ReaderLost, match="out of step"):
            readers.answer(readers.send(0, 0, f.fileno(), pos=0, n=16, pieces=[], fresh=True))
        t.join(30)
        assert sleeper.poll() is not None and readers._procs[0] is None
    finally:
        theirs.close()
        readers.close()


def test_a_worker_that_cannot_be_restarted_leaves_the_host_path(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (round 4, session 2): when no new worker could be spawned (the
    interpreter gone after a venv rebuild, fork refused) the restore raised a bare
    FileNotFoundError; it now reads on the host path, and so does every restore
    until a worker starts again."""
    store, ident, cache, _ = _saved(tiny, tmp_path)
    ring = proc_ring(1, 1024)
    try:
        assert ring.readers is not None
        os.kill(_pids(ring)[0], signal.SIGKILL)
        ring.readers._procs[0].wait()  # type: ignore[union-attr]
        monkeypatch.setattr(readers_mod.sys, "executable", str(tmp_path / "gone" / "python"))
        with staged(ring):
            for _ in range(2):
                got = store.restore("s", identity=ident).cache
                assert_same_state(live_state(got), live_state(cache))
        monkeypatch.undo()
        with staged(ring):
            got = store.restore("s", identity=ident).cache
        assert_same_state(live_state(got), live_state(cache))
        assert _pids(ring)
    finally:
        assert ring.readers is not None
        ring.readers.close()
        store.close()


@pytest.mark.usefixtures("python_ctrl_c")
def test_ctrl_c_ends_a_restore_that_waits_on_a_stopped_worker(tiny: Any, tmp_path: Path) -> None:
    """Attack (round 4, session 2): two Ctrl-Cs could not end a restore waiting on a
    stopped worker.  A Ctrl-C (a real SIGINT) now kills the workers, the readers
    stop, KeyboardInterrupt is raised, and the next restore starts new workers."""
    store, ident, cache, _ = _saved(tiny, tmp_path)
    ring = proc_ring(1, 1024)
    try:
        stopped = _pids(ring)[0]
        os.kill(stopped, signal.SIGSTOP)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        with staged(ring):
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                store.restore("s", identity=ident)
            timer.join()
            assert all_free(ring)
            got = store.restore("s", identity=ident).cache
        assert_same_state(live_state(got), live_state(cache))
        assert _pids(ring)[0] != stopped
    finally:
        assert ring.readers is not None
        ring.readers.close()
        store.close()


def test_a_ctrl_c_between_submits_settles_the_jobs_submitted(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (round 4, session 2): a Ctrl-C while the jobs were being handed to the
    reader threads skipped the cleanup: the ring was released with a job still
    reading into its lanes, and the next restore shared them."""
    store, ident, cache, _ = _saved(tiny, tmp_path)
    ring = host_ring(2, 1024)
    finished: list[bool] = []
    read = staging._lane

    def slow_job(*a: Any) -> None:
        time.sleep(0.5)
        read(*a)
        finished.append(True)

    pool = ring.pool()

    class Interrupting:
        calls = 0

        def submit(self, *a: Any) -> Any:
            Interrupting.calls += 1
            if Interrupting.calls == 2:
                raise KeyboardInterrupt  # the Ctrl-C, after the first job went out
            return pool.submit(*a)

    monkeypatch.setattr(staging, "_lane", slow_job)
    monkeypatch.setattr(ring, "pool", lambda: Interrupting())
    try:
        with staged(ring), pytest.raises(KeyboardInterrupt):
            store.restore("s", identity=ident)
        assert finished == [True] and all_free(ring)  # settled before it was raised
        monkeypatch.undo()
        with staged(ring):
            got = store.restore("s", identity=ident).cache
        assert_same_state(live_state(got), live_state(cache))
    finally:
        store.close()


def test_closed_readers_give_back_their_shared_file() -> None:
    """Attack (round 4, session 3): closing the readers stopped the workers but kept
    the slots' memfd open: one descriptor per ring ever made."""
    Readers(1, 4096).close()  # whatever a first start opens once and keeps
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        readers = Readers(2, 4096)
        readers.close()
        readers.close()  # twice: nothing more to close
        with pytest.raises(readers_mod.ReaderLost):
            readers.ready(0)  # closed: no worker starts again
        del readers  # the mapping (and mmap's own descriptor) goes with the last view
    assert len(os.listdir("/proc/self/fd")) == before


def test_warm_starts_the_lanes_and_has_every_worker_fill_its_slots() -> None:
    """``Ring.warm`` (``persist serve`` before it answers): the lane threads started, and
    each reader process has read into both of its slots once (zeros from a sparse
    file), so a first restore neither starts threads nor maps pages."""
    ring = proc_ring(2, 1 << 16)
    try:
        for lane in ring.lanes:
            for slot in lane.slots:
                np.asarray(slot)[:] = 0xAB  # what a worker's read must replace
        ring.warm()
        assert ring._pool is not None
        for lane in ring.lanes:
            for slot in lane.slots:
                assert not np.asarray(slot).any()  # written by the lane's worker
        ring.readers.close()  # type: ignore[union-attr]
        with pytest.raises(readers_mod.ReaderLost):
            ring.warm()  # closed: typed, never a hang
    finally:
        if ring.readers is not None:
            ring.readers.close()


def test_prepare_goes_on_when_the_lanes_cannot_be_warmed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``Ring.warm`` is a head start, never a reason for ``persist serve`` not to start:
    a reader process that cannot start is said once, and a restore starts it again."""
    ring = host_ring(2, 1024)

    def lost() -> None:
        raise readers_mod.ReaderLost("reader process 0 did not start")

    monkeypatch.setattr(ring, "warm", lost)
    chosen = pinned.Choice(pinned.CUDA_PINNED, "test", ring, object())  # type: ignore[arg-type]
    monkeypatch.setattr(staging, "data_path", lambda: chosen)
    monkeypatch.setattr("persist.cuda.kernels.warm", lambda staged: None)
    with caplog.at_level("WARNING", logger="persist"):
        assert staging.prepare() is True
    assert "not warmed" in caplog.text
