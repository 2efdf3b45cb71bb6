"""The staged restore (format/pinned + engine/staging): blobs through a ring of
staging buffers into arrays of their own, against the host path, bit for bit.

On CUDA the ring is the real one (page-locked memory, the copy kernel), plus a
ring of tiny real slots so that tensors span slots; elsewhere a ring of plain
host buffers whose copy is ``mx.array`` runs the same pipeline (threads,
hashing, slot reuse, cutting, assembly).  The selection and its fallbacks are
tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import persist
from persist.errors import CorruptBlobError
from persist.format import pinned
from persist.format.pinned import CUDA_PINNED, HOST, Choice, Ring
from tests.engine.test_partial_reads import full_then_trim, whole_buffers
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

BLOCK = 16
FAMILIES = ["llama", "gemma3", "qwen3_next", "mamba2", "falcon_h1", "llama4"]


def host_ring(slots: int, size: int) -> Ring:
    bufs = [np.zeros(size, dtype=np.uint8) for _ in range(slots)]
    return Ring(bufs, lambda i, n: mx.array(bufs[i][: -(-n // 16) * 16]))  # a copy


def small_ring() -> Ring:
    """Slots far smaller than a tensor run: every tensor spans slots."""
    if ON_CUDA:
        return pinned._cuda_ring(pinned._Driver(), 3, 1024)
    return host_ring(3, 1024)


@pytest.fixture(scope="module")
def rings() -> dict[str, Ring]:
    out = {"small": small_ring()}
    if ON_CUDA:
        chosen = pinned.choose()
        assert chosen.path == CUDA_PINNED, chosen.reason
        assert chosen.ring is not None
        out["default"] = chosen.ring
    else:
        out["default"] = host_ring(pinned.SLOTS, 64 << 10)
    return out


def staged(ring: Ring) -> Any:
    return pinned.use(Choice(CUDA_PINNED, "test ring", ring))


def host() -> Any:
    return pinned.use(Choice(HOST, "test"))


def all_free(ring: Ring) -> bool:
    return ring.free.qsize() == len(ring.slots)


@pytest.mark.parametrize("ring_name", ["default", "small"])
@pytest.mark.parametrize("variant", FAMILIES)
def test_a_staged_restore_is_the_host_restore(
    variant: str, ring_name: str, rings: dict[str, Ring], tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny(variant)
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(70, seed=11)
    cache, _ = prefill(model, prompt, step=30)
    ring = rings[ring_name]
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


@pytest.mark.parametrize("ring_name", ["default", "small"])
@pytest.mark.parametrize("n,k", [(200, 40), (200, 48), (70, 67)])
def test_a_staged_partial_hit_is_a_full_restore_trimmed(
    n: int, k: int, ring_name: str, rings: dict[str, Ring], tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    stored = tokens_for(n, seed=3)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(prefill(model, stored)[0], stored, identity=ident, session="s")
        prompt = stored[:k] + [(stored[k] + 1) % 256, 5]
        with staged(rings[ring_name]):
            hit = store.lookup(prompt, identity=ident)
        with host():
            trimmed = full_then_trim(store, "s", ident, k)
    assert hit is not None and len(hit.tokens) == k
    assert_same_state(live_state(hit.cache), live_state(trimmed))
    assert whole_buffers(hit.cache) == whole_buffers(trimmed)


def test_a_damaged_tensor_is_refused_and_the_ring_recovers(
    rings: dict[str, Ring], tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(100, seed=2)
    cache = prefill(model, prompt)[0]
    ring = rings["small"]
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        info = store.save(cache, prompt, identity=ident, session="s")
        block = store.index.blocks(info.id)[2].blob
        assert block is not None
        path = store.blobs.path(block)
        good = path.read_bytes()
        data = bytearray(good)
        data[-5] ^= 0xFF  # inside the last tensor's bytes
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with staged(ring), pytest.raises(CorruptBlobError, match="checksum mismatch"):
            store.restore("s", identity=ident)
        assert all_free(ring)
        path.write_bytes(good)  # mended: the next restore through the ring works
        with staged(ring):
            again = store.restore("s", identity=ident).cache
    assert_same_state(live_state(again), live_state(cache))
    assert all_free(ring)


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
    first = pinned.choose()
    assert first.path == HOST and first.ring is None
    assert "MLX runs on cpu" in first.reason
    assert pinned.choose() is first


def test_the_host_path_can_be_asked_for(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSIST_DATA_PATH", "host")
    assert pinned.choose() == Choice(HOST, "PERSIST_DATA_PATH=host")


def test_without_the_driver_library_the_host_path_is_taken(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "backend", lambda: "cuda")

    def no_lib(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(pinned.ctypes, "CDLL", no_lib)
    got = pinned.choose()
    assert got.path == HOST and got.ring is None
    assert "CUDA driver API unavailable (libcuda.so.1: cannot open" in got.reason


class FakeDriver:
    """The driver's answers without a GPU: host_alloc from numpy, or refused."""

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.keep: list[np.ndarray] = []

    def host_alloc(self, n: int) -> tuple[int, int]:
        if self.refuse:
            raise MemoryError(f"cuMemHostAlloc of {n} bytes returned CUDA error 2")
        buf = np.zeros(n, dtype=np.uint8)
        self.keep.append(buf)
        return buf.ctypes.data, buf.ctypes.data


def test_a_refused_pinned_allocation_falls_back(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "backend", lambda: "cuda")
    monkeypatch.setattr(pinned, "_Driver", lambda: FakeDriver(refuse=True))
    got = pinned.choose()
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

    monkeypatch.setattr(pinned, "_Driver", driver)
    got = pinned.choose()
    assert got.path == CUDA_PINNED and got.ring is not None
    assert len(got.ring.slots) == pinned.SLOTS
    assert got.ring.slot_bytes == pinned.SLOT_BYTES
    got.ring.slots[3][:4] = 7  # the slots are the driver's memory
    assert made[0].keep[3][:4].tolist() == [7, 7, 7, 7]
    assert pinned.choose() is got and len(made) == 1
