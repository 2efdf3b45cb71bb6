"""A restore and a save with no kernel of persist's to compile (issue 39): addresses
from ``cuda/addressing`` (a PTX kernel on CUDA, DLPack on the CPU), buffers from
``mx.zeros``, slots copied straight to their tensors.  The addresses are checked
against the host's view of the same bytes on the CPU; on CUDA a direct restore and
a save's read-back must not compile a single kernel nor move an array to managed
memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import persist
from persist.cuda import addressing, kernels, pinned
from tests.helpers import ON_CUDA, assert_same_state, live_state, prefill, tokens_for
from tests.host_lanes import address as host_address
from tests.host_lanes import host_ring, staged


@pytest.mark.parametrize("dtype", [mx.uint8, mx.bfloat16, mx.float32, mx.int64])
def test_an_address_is_where_the_array_s_bytes_are(dtype: Any) -> None:
    a = mx.arange(2 * 3 * 40).reshape(2, 3, 40).astype(dtype)
    row = a[1]  # a view at an offset
    flat = a.reshape(-1)
    mx.eval(a, row, flat)
    for x in (a, row, flat):
        if ON_CUDA:
            assert addressing.address(x) != 0
        else:
            assert addressing.address(x) == host_address(x)


def test_a_strided_view_has_no_address() -> None:
    a = mx.zeros((4, 6, 8))
    mx.eval(a)
    for view in (a[:, 1:3], a.transpose(0, 2, 1), a[..., ::2]):
        mx.eval(view)
        with pytest.raises(ValueError, match="not contiguous"):
            addressing.address(view)


def test_zeroed_buffers_are_zero_and_16_byte_rounded() -> None:
    got = addressing.zeroed([1, 16, 17, 1000])
    assert [b.nbytes for b, _ in got] == [16, 16, 32, 1008]
    for b, addr in got:
        assert not np.array(b).any() and addr != 0


def test_a_direct_ring_restores_what_was_saved_on_the_host(tiny: Any, tmp_path: Path) -> None:
    """The CPU's stand-in for the copy engine: the pipeline of a direct ring, bit
    for bit (tests/engine/test_staging.py runs every family through it)."""
    model, tok, _ = tiny("gemma3")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(90, seed=4)
    cache = prefill(model, prompt)[0]
    ring = pinned._cuda_ring(pinned.Driver(), 3, 1024, straight=True) if ON_CUDA else (
        host_ring(3, 1024, direct=True))  # fmt: skip
    with persist.Store(tmp_path / "s", block_tokens=16) as store:
        store.save(cache, prompt, identity=ident, session="s")
        with staged(ring):
            back = store.restore("s", identity=ident).cache
    assert_same_state(live_state(back), live_state(cache))


@pytest.mark.skipif(not ON_CUDA, reason="MLX's CUDA backend (kernels are built there only)")
def test_a_direct_restore_and_a_save_build_no_kernel(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.cuda_memory import buffers, managed

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(120, seed=6)
    mx.clear_cache()  # the host reads of earlier tests left managed buffers in MLX's cache
    cache = prefill(model, prompt)[0]
    ring = pinned._cuda_ring(pinned.Driver(), 3, 1 << 20, straight=True)

    def refuse(*args: Any) -> Any:
        raise AssertionError(f"a kernel was built: {args[0]}")

    monkeypatch.setenv("PERSIST_STAGING", "direct")  # the save's addresses too
    monkeypatch.setattr(kernels, "_kernel", refuse)
    with persist.Store(tmp_path / "s") as store, staged(ring):
        store.save(cache, prompt, identity=ident, session="s")
        back = store.restore("s", identity=ident).cache
    # in device memory, both: a DLPack export would have moved them to managed memory
    # for good (before live_state's host reads, which do)
    assert not any(managed(a) for a in buffers(cache))
    assert not any(managed(a) for a in buffers(back))
    assert_same_state(live_state(back), live_state(cache))


@pytest.mark.parametrize(
    "asked,expect",
    [("direct", True), ("whole", False), ("rounds", False), ("", pinned.DIRECT_BY_DEFAULT)],
)
def test_persist_staging_picks_the_way(
    asked: str, expect: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSIST_STAGING", asked)
    assert pinned.direct() is expect
