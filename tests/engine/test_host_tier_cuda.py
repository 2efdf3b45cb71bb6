"""The host tier on CUDA, for real: pinned pages, the pack/unpack kernels, device memory.

Skipped off CUDA (and where the process's data path is not ``cuda-pinned``); the
CPU tests run the same pool and tier through host pages (test_host_tier_pages.py,
tests/format/test_pinned_pool.py).  On an NVIDIA GPU:

    python -m pytest -q tests/engine/test_host_tier_cuda.py
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import persist
from bench.servers import Server
from persist.cuda import pinned
from persist.cuda.kernels import device_buffers
from persist.cuda.pinned_pool import cuda_holder
from persist.engine.host.tier import HostTier
from tests.cuda_memory import buffers, managed
from tests.helpers import NEXT, ON_CUDA, assert_same_state, live_state, prefill, tokens_for
from tests.host_pages import (
    DTYPES,
    given_back_exactly,
    holds_no_array,
    odd_arrays,
    pages_in_use,
    sample,
)
from tests.serve.servers import OTHER, TURN1, TURN2, cached, hits, metrics, scrape, text

pytestmark = pytest.mark.skipif(
    not ON_CUDA or pinned.data_path().path != pinned.CUDA_PINNED,
    reason="the CUDA host tier: pinned pages and kernels (an NVIDIA GPU)",
)

GIB = 1 << 30
PINNED = "pinned host memory"


@pytest.mark.parametrize("page", [4096, 2 << 20])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_bit_exact_for_odd_sizes(dtype: Any, page: int) -> None:
    holder = cuda_holder(64 << 20, page_bytes=page, chunk_bytes=16 * page)
    held = given_back_exactly(holder, odd_arrays(dtype, page))
    holder.release(held)
    holder.trim()
    assert holder.pinned_bytes() == 0


def test_unpacked_arrays_live_in_device_memory() -> None:
    host = mx.array(np.zeros(4096, dtype=np.float32))
    mx.eval(host)
    assert managed(host)  # the control: MLX puts arrays made from host memory there
    holder = cuda_holder(64 << 20)
    arrays = [sample(1 << 20, mx.bfloat16, 1), sample(4097, mx.uint8, 2)]
    held = holder.hold(arrays)
    # MLX's buffer cache hands a kernel output any freed buffer of its size,
    # managed or not: the samples' host-made temporaries are dropped first
    mx.clear_cache()
    for a in holder.give(held):
        assert not managed(a)  # a kernel output: device memory
    holder.release(held)


@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])
def test_the_tier_holds_no_device_array_and_hits_are_exact(tiny: Any, variant: str) -> None:
    model, _, _ = tiny(variant)
    toks = tokens_for(300, seed=51)
    cache, _ = prefill(model, toks)
    want = live_state(cache)
    tier = HostTier(GIB)
    assert tier.holder is not None and tier.where == PINNED
    assert tier.keep("m", toks, cache)
    del cache
    # live_state read the cache on the host, which moved its buffers to managed
    # memory; freed, MLX's buffer cache would hand them to the next kernel outputs
    mx.clear_cache()
    assert holds_no_array(tier) and pages_in_use(tier) == tier.nbytes > 0
    hit = tier.fetch("m", [*toks, *NEXT])
    assert hit is not None and hit.tokens == toks
    assert buffers(hit.cache) and not any(managed(a) for a in buffers(hit.cache))
    assert_same_state(live_state(hit.cache), want)
    tier.clear()
    assert tier.holder.pinned_bytes() == 0


@pytest.mark.long
def test_serve_restores_an_evicted_conversation_from_pinned_memory(
    model_dir: Any, tmp_path: Path
) -> None:
    """On by default on CUDA; the answer equals the one restored from the store."""
    model = model_dir("llama")
    answers, health = [], {}
    for name, extra in (("store", ["--host-cache", "0"]), ("host", [])):
        args = ["persist", "serve", "--model", str(model), "--store", str(tmp_path / name)]
        log = tmp_path / f"{name}.log"
        srv = Server([*args, *extra, "--prompt-cache-size", "1"], log)
        try:
            one = srv.chat(TURN1)
            srv.chat(OTHER)  # mlx-lm keeps one cache: TURN1's is evicted
            before = metrics(srv)
            answers.append(srv.chat(TURN2))
            after = metrics(srv)
            if name == "host":
                health = json.loads(scrape(srv, "/health"))
        finally:
            srv.stop()
        assert cached(answers[-1]) >= one["usage"]["prompt_tokens"] - 8
        source = "host" if name == "host" else "local"
        assert hits(after, source) - hits(before, source) == 1
    assert "host cache off" in (tmp_path / "store.log").read_text()
    assert f"in {PINNED}" in (tmp_path / "host.log").read_text()  # the start line
    # the budget pinned before the first request: pinning beside requests stalls them
    assert f"MiB of {PINNED} pinned in" in (tmp_path / "host.log").read_text()
    assert health["host_cache"]["where"] == PINNED and health["host_cache"]["pinned_bytes"] > 0
    assert text(answers[1]) == text(answers[0])


def test_a_save_leaves_no_managed_buffer_behind(tiny: Any, tmp_path: Path) -> None:
    """The save reads the cache on the host through device copies; read through
    MLX they would turn managed, and once freed MLX's buffer cache would hand
    them to the next kernel outputs of their size (here: a restore's buffers)."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(256, seed=5)  # the live slice is the whole buffer: copies of its size
    cache, _ = prefill(model, toks)
    mx.clear_cache()
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident, session="s")
        gc.collect()
        assert not any(managed(a) for a in buffers(cache))
        made = device_buffers([a.nbytes for a in buffers(cache)])
        assert not any(managed(a) for a, _ in made)
        del made
        # the test's own host reads (identity hashing, addresses) left managed
        # buffers in MLX's cache: dropped, so the restore's are its own
        mx.clear_cache()
        back = store.restore("s", identity=ident).cache
        assert not any(managed(a) for a in buffers(back))
