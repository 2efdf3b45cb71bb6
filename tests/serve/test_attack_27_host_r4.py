"""Attack 27 (round 4) on the host tier: each finding of the outside attack on the
pinned-page host tier, as a test (CPU: the page logic through host pages)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import persist
from persist.cuda import pinned
from persist.cuda.pinned import CUDA_PINNED, Choice
from persist.engine.host import tier as host_tier
from persist.engine.host.store_hooks import from_host
from persist.engine.host.tier import HostTier
from persist.errors import InvalidStateError, NotResumableError
from persist.identity import ModelIdentity
from persist.serve.server import PersistentPromptCache
from tests.helpers import prefill, tokens_for
from tests.host_pages import HostChunks, host_holder

IDENT = ModelIdentity("llama", "c", "w", "t", "ct")


class UnknownCache(KVCache):  # a model's own cache class persist has no codec for
    pass


def _unknown() -> list[Any]:
    c = UnknownCache()
    c.update_and_fetch(mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4)))
    return [c]


def test_a_keep_that_fails_in_an_eviction_never_reaches_mlx_lm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A keep that raised inside mlx-lm's eviction left its byte count wrong and failed
    every later insert (persist serve answered 503, then exited)."""
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(2, 40000, store=store, identity=IDENT, host=HostTier(1 << 30))
        try:
            with caplog.at_level(logging.WARNING, logger="persist"):
                for i in range(6):
                    pc.insert_cache("m", [i] * 8 + [1, 2], _unknown())
            assert len(pc) == 2 and pc.nbytes == 2 * sum(c.nbytes for c in _unknown())
            assert "could not keep an evicted cache" in caplog.text
        finally:
            pc.close()


def test_a_cache_kept_under_other_tokens_is_refused(tiny: Any) -> None:
    model, _, _ = tiny("llama")
    toks = tokens_for(100, seed=5)
    cache = prefill(model, toks)[0]
    for tier in (HostTier(1 << 30), HostTier(1 << 30, holder=host_holder(1 << 30))):
        with pytest.raises(NotResumableError, match="covers 100 positions but 101"):
            tier.keep("m", [*toks, 7], cache)
        assert len(tier) == 0


def test_a_closed_tier_pins_nothing_more(tiny: Any) -> None:
    """A save that committed beside Store.close kept its copy in the cleared tier: pages
    pinned for the life of the process."""
    model, _, _ = tiny("llama")
    toks = tokens_for(40, seed=6)
    chunks = HostChunks()
    tier = HostTier(1 << 30, holder=host_holder(1 << 30, chunks=chunks))
    assert tier.keep("m", toks, prefill(model, toks)[0], copy=True)
    tier.clear(close=True)
    assert not tier.keep("m", toks, prefill(model, toks)[0], copy=True)
    assert len(tier) == 0 and tier.stats().get("pinned_bytes", 0) == 0


def test_a_lookup_beside_a_close_is_a_typed_error(tmp_path: Path) -> None:
    class Closing:
        index = persist.Store(tmp_path / "s").index
        costs = None
        host = None  # the close dropped the tier between host_hit() and from_host()
        blobs = None
        block_tokens = 16
        strict_backend = False

    with pytest.raises(InvalidStateError, match="closed"):
        from_host(Closing(), [1, 2, 3], IDENT, "default", "who", 0, None)  # type: ignore[arg-type]


def test_a_small_host_cache_on_cuda_is_checked_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --host-cache below the page-spanning check's 4 MiB turned the tier off,
    saying its pages had failed."""
    monkeypatch.setattr(
        host_tier,
        "cuda_holder",
        lambda budget: host_holder(budget, page_bytes=2 << 20, chunk_bytes=2 << 20),
    )
    with pinned.use(Choice(CUDA_PINNED, "a test's stand-in")):
        tier = HostTier(3 << 20)
    assert tier.holder is not None and tier.max_bytes == 3 << 20
