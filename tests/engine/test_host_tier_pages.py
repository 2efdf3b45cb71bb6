"""The host tier through a page holder (the CUDA tier's pool, layout and bookkeeping;
host pages and memmoves stand in for pinned memory and the kernels: tests/host_pages.py).

Every hit equals the one the plain tier gives, bit for bit, with the same room;
the tier holds no array of its own; eviction and ``clear`` give pages back; a hit
never shares memory with what is kept; and ``Store``/``persist serve`` take the
pages wherever the process's data path is ``cuda-pinned``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import persist
from persist.cuda import pinned
from persist.cuda.pinned import CUDA_PINNED, Choice
from persist.engine.host import placement as host_placement
from persist.engine.host.placement import DEVICE_MEMORY, default_budget
from persist.engine.host.tier import HostTier
from persist.errors import NotResumableError
from persist.serve.app import host_budget
from persist.serve.server import PersistentPromptCache
from tests.engine.host_checks import scribble_all
from tests.helpers import (
    NEXT,
    assert_same_state,
    continue_run,
    kv_quantized,
    live_state,
    prefill,
    raw,
    tokens_for,
)
from tests.host_pages import WHERE, HostChunks, holds_no_array, host_holder, pages_in_use

GIB = 1 << 30
FAMILIES = ["llama", "gemma3", "qwen3_next", "mamba2", "falcon_h1", "llama4"]


def paged(budget: int = GIB, chunks: HostChunks | None = None) -> HostTier:
    return HostTier(budget, holder=host_holder(budget, chunks=chunks))


def plain_tier(budget: int = GIB) -> HostTier:
    """The tier without pages (MLX arrays kept as they are), also on CUDA."""
    with pinned.use(Choice(pinned.HOST, "the plain tier")):
        return HostTier(budget)


def rooms(cache: list[Any]) -> list[Any]:
    """Each layer's key buffers' shapes (a quantized layer's three): live and spare room."""
    out = []
    for c in cache:
        keys = getattr(c, "keys", None)
        parts = keys if isinstance(keys, (tuple, list)) else [keys]
        out.append([tuple(k.shape) for k in parts if k is not None])
    return out


class Spoiled:
    """A holder whose pages give back ``spoil`` of what they held (another MLX build
    compiling the kernels differently, say)."""

    def __init__(self, inner: Any, spoil: Any) -> None:
        self.inner, self.spoil = inner, spoil

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def give(self, held: Any) -> list[mx.array]:
        return list(self.spoil(self.inner.give(held)))


@pytest.mark.parametrize("variant", [*FAMILIES, "quantized"])
def test_a_paged_hit_is_the_plain_one_bit_for_bit(tiny: Any, variant: str) -> None:
    model, _, _ = tiny("llama_hd64" if variant == "quantized" else variant)
    toks = tokens_for(150, seed=21)
    make = (lambda: kv_quantized(model, toks, 100)) if variant == "quantized" else None
    plain, pages = plain_tier(), paged()
    assert plain.holder is None and pages.where == WHERE
    plain.keep("m", toks, make() if make else prefill(model, toks)[0])
    cache = make() if make else prefill(model, toks)[0]
    want = live_state(cache)
    assert pages.keep("m", toks, cache)  # given up, as mlx-lm's eviction does
    del cache
    assert holds_no_array(pages) and pages_in_use(pages) == pages.nbytes > 0
    for prompt in ([*toks, *NEXT], toks, [*toks[:100], 7, 8, 9]):
        a, b = plain.fetch("m", prompt), pages.fetch("m", prompt)
        assert (a is None) == (b is None), prompt
        if a is None or b is None:
            continue
        assert a.tokens == b.tokens and a.nbytes == b.nbytes
        assert_same_state(live_state(b.cache), live_state(a.cache))
        assert rooms(b.cache) == rooms(a.cache)  # the same room to grow into
        if b.tokens == toks:
            assert_same_state(live_state(b.cache), want)
    hit = pages.fetch("m", [*toks, *NEXT])
    assert hit is not None
    fresh = make() if make else prefill(model, toks)[0]
    got_logits, got = continue_run(model, hit.cache, NEXT, n_greedy=2)
    want_logits, want_greedy = continue_run(model, fresh, NEXT, n_greedy=2)
    assert got == want_greedy
    assert all(raw(x) == raw(y) for x, y in zip(got_logits, want_logits, strict=True))


@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])
def test_a_kept_copy_and_a_hit_share_no_memory(tiny: Any, variant: str) -> None:
    model, _, _ = tiny(variant)
    toks = tokens_for(256, seed=22)
    cache, _ = prefill(model, toks)
    saved = live_state(cache)
    tier = paged()
    assert tier.keep("m", toks, cache, copy=True)  # a Store's save: the caller goes on
    scribble_all(cache)
    continue_run(model, cache, NEXT, n_greedy=2)
    first = tier.fetch("m", [*toks, 1, 2])
    assert first is not None
    assert_same_state(live_state(first.cache), saved)
    scribble_all(first.cache)  # written through a memoryview: the pages are not
    second = tier.fetch("m", [*toks, 1, 2])
    assert second is not None
    assert_same_state(live_state(second.cache), saved)


def test_eviction_and_clear_give_pages_back(tiny: Any) -> None:
    model, _, _ = tiny("llama")
    prompts = [tokens_for(100, seed=s) for s in (30, 31, 32)]
    probe = paged()
    probe.keep("m", prompts[0], prefill(model, prompts[0])[0])
    size = probe.nbytes  # whole pages
    chunks = HostChunks()
    tier = paged(2 * size, chunks)
    for p in prompts[:2]:
        assert tier.keep("m", p, prefill(model, p)[0])
    assert tier.fetch("m", [*prompts[0], 1]) is not None  # 0 is now the most recent
    made = chunks.made
    assert tier.keep("m", prompts[2], prefill(model, prompts[2])[0])  # 1 goes first
    assert tier.stats()["evicted"] == 1 and len(tier) == 2
    assert tier.nbytes == pages_in_use(tier) == 2 * size <= tier.max_bytes
    assert chunks.made == made  # the evicted entry's pages were reused
    assert tier.fetch("m", [*prompts[1], 1]) is None
    assert tier.fetch("m", [*prompts[2], 1]) is not None
    stats = tier.stats()
    assert stats["where"] == WHERE and stats["pinned_bytes"] == chunks.nbytes > 0
    tier.clear()
    assert pages_in_use(tier) == 0 and not chunks.chunks and chunks.freed == chunks.made
    assert tier.keep("m", prompts[0], prefill(model, prompts[0])[0])  # pinned again on need


def test_refused_memory_evicts_then_gives_up_cleanly(tiny: Any) -> None:
    model, _, _ = tiny("llama")
    prompts = [tokens_for(100, seed=s) for s in (40, 41)]
    probe = paged()
    probe.keep("m", prompts[0], prefill(model, prompts[0])[0])
    chunks = HostChunks(refuse_after=probe.nbytes // 4096)  # pages for one entry
    tier = HostTier(GIB, holder=host_holder(GIB, chunk_bytes=4096, chunks=chunks))
    assert tier.keep("m", prompts[0], prefill(model, prompts[0])[0])
    assert tier.keep("m", prompts[1], prefill(model, prompts[1])[0])  # the first made room
    assert len(tier) == 1 and tier.stats()["evicted"] == 1
    assert tier.fetch("m", [*prompts[1], 1]) is not None
    big = tokens_for(400, seed=42)
    assert not tier.keep("m", big, prefill(model, big)[0])  # never fits what is pinned
    # ... and the entries that do fit stay (attack 27, round 4: it emptied the tier)
    assert len(tier) == 1 and tier.fetch("m", [*prompts[1], 1]) is not None


def test_where_the_tier_keeps_entries_and_the_serve_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = plain_tier()
    assert plain.holder is None
    assert plain.where == {"cpu": "host memory", "cuda": DEVICE_MEMORY}[pinned.backend()]
    assert host_budget(None) == default_budget() and host_budget(0) == 0
    monkeypatch.setattr(host_placement, "cuda_holder", lambda budget: host_holder(budget))
    with pinned.use(Choice(CUDA_PINNED, "a test's stand-in")):
        tier = HostTier(GIB)
        assert tier.holder is not None and tier.where == WHERE
        assert host_budget(None) == default_budget()  # on by default: no device memory held
        assert HostTier(0).holder is None
    monkeypatch.setattr(pinned, "backend", lambda: "cuda")
    with pinned.use(Choice(pinned.HOST, "no pinned memory")):
        assert host_placement.placement() == DEVICE_MEMORY
        assert host_budget(None) == 0  # would hold device memory: off unless asked
        assert host_budget(1 << 20) == 1 << 20


def test_a_store_keeps_its_saves_in_pages_on_the_pinned_path(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(200, seed=23)
    cache, _ = prefill(model, toks)
    monkeypatch.setattr(host_placement, "cuda_holder", lambda budget: host_holder(budget))
    with pinned.use(Choice(CUDA_PINNED, "a test's stand-in")):  # only the tier's choice
        store = persist.Store(tmp_path / "store", host_cache=GIB)
    with store:
        store.save(cache, toks, identity=identity, session="s")
        assert store.host is not None and holds_no_array(store.host)
        hit = store.lookup([*toks, 1], identity=identity)
        assert hit is not None and hit.source == "host" and hit.tokens == toks
        assert_same_state(live_state(hit.cache), live_state(cache))
        host = store.stats().host_cache
        assert host is not None and host["where"] == WHERE and host["pinned_bytes"] > 0


def test_serve_restores_an_evicted_cache_from_pages(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    a, b = tokens_for(80, seed=24), tokens_for(80, seed=25)
    first, _ = prefill(model, a)
    want = live_state(first)
    host = paged()
    with persist.Store(tmp_path / "store") as store:
        pc = PersistentPromptCache(1, store=store, identity=identity, host=host)
        try:
            pc.insert_cache("m", a, first)
            pc.insert_cache("m", b, prefill(model, b)[0])  # mlx-lm keeps one: a's goes to pages
            pc.flush()
            assert len(host) == 1 and holds_no_array(host)
            cache, rest = pc.fetch_nearest_cache("m", [*a, 5])
            assert rest == [5] and pc.counters["host_hits"] == 1
            assert_same_state(live_state(cache), want)
            assert isinstance(cache[0].keys, mx.array)
        finally:
            pc.close()


def test_pages_that_give_back_other_bytes_are_never_used() -> None:
    """The tier trusts pinned pages only once they gave back what they held, bit
    for bit (another MLX build might compile the kernels differently)."""
    from persist.cuda.pinned_pool import proven

    good = host_holder(64 << 20)
    assert proven(good, 64 << 20) is None

    def one_off(out: list[mx.array]) -> list[mx.array]:
        out[-1] = out[-1] + mx.array(1, dtype=out[-1].dtype)  # one tensor off
        return out

    assert proven(Spoiled(host_holder(64 << 20), one_off), 64 << 20) == (
        "they gave back other bytes than they held"
    )


def test_a_tier_whose_pages_fail_their_check_keeps_nothing(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never a wrong cache, and never device memory that mlx-lm's eviction meant to
    free: pages that give back other bytes turn the tier off (said in ``where``)."""

    def zeroed(out: list[mx.array]) -> list[mx.array]:
        return [mx.zeros_like(a) for a in out]

    monkeypatch.setattr(
        host_placement, "cuda_holder", lambda budget: Spoiled(host_holder(budget), zeroed)
    )
    with pinned.use(Choice(CUDA_PINNED, "a test's stand-in")):
        tier = HostTier(GIB)
    assert tier.holder is None and tier.max_bytes == 0 and tier.where.startswith("off")
    model, _, _ = tiny("llama")
    toks = tokens_for(40, seed=3)
    assert not tier.keep("m", toks, prefill(model, toks)[0]) and len(tier) == 0


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


def test_a_small_host_cache_on_cuda_is_checked_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --host-cache below the page-spanning check's 4 MiB turned the tier off,
    saying its pages had failed."""
    monkeypatch.setattr(
        host_placement,
        "cuda_holder",
        lambda budget: host_holder(budget, page_bytes=2 << 20, chunk_bytes=2 << 20),
    )
    with pinned.use(Choice(CUDA_PINNED, "a test's stand-in")):
        tier = HostTier(3 << 20)
    assert tier.holder is not None and tier.max_bytes == 3 << 20
