"""Incremental saves never keep a stale block (issue 23.1).

Code that edits caches writes into their arrays in place (``c.keys[..., 5, :] = x``:
attention sinks, KV compression, speculative rollbacks); MLX keeps the Python
object and even its buffer, so nothing but the bytes can tell.  Every test saves
the session again, restores it in another Store and compares with memory bit for
bit; the property test drives random in-place edits, trims and extensions of
several cache families between the saves.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

import persist
from tests.helpers import assert_same_state, live_state, prefill, tokens_for

BLOCK = 16
IDENT = persist.ModelIdentity("sound", "c", "w", "t", "h", name="sound")
# the quantized family's caches are saved only under their own kv_bits (layer_checks)
Q_IDENT = persist.ModelIdentity(
    "sound", "c", "w", "t", "h", (("kv_bits", 8), ("kv_group_size", 32)), name="sound"
)


def test_in_place_writes_reach_the_next_save(tiny: Any, tmp_path: Path) -> None:
    """The issue's case: one position of one layer's keys, and positions 16..30 of
    every layer's values, rewritten in place between two saves of one session."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(200, seed=90)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        store.save(cache, toks, identity=ident, session="chat")
        k = cache[0].keys
        k[..., 5, :] = mx.ones(k[..., 5, :].shape, dtype=k.dtype)
        for c in cache:
            v = c.values
            v[..., 16:31, :] = v[..., 16:31, :] * 2 + 1
        mx.eval([c.state for c in cache])
        store.save(cache, toks, identity=ident, session="chat")
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as fresh:
        got = fresh.restore("chat", identity=ident)
        assert_same_state(live_state(got.cache), live_state(cache))
        # another prompt sharing the first 100 tokens inherits the new blocks too
        hit = fresh.lookup([*toks[:100], 1, 2, 3], identity=ident)
        assert hit is not None and len(hit.tokens) >= 64
        n = len(hit.tokens)
        want = prefill(model, toks[:1])[0]  # the right classes, refilled below
        for w, c in zip(want, cache, strict=True):
            w.keys, w.values = c.keys[..., :n, :], c.values[..., :n, :]
            w.offset = n
        assert_same_state(live_state(hit.cache), live_state(want))


# -- the property test --------------------------------------------------------------

H, D = 2, 32


def _rand(shape: tuple[int, ...], seed: int, dtype: Any = mx.float16) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _family(name: str, n: int, seed: int) -> list[Any]:
    """A cache of ``n`` tokens: two layers of one family (a hybrid mixes kinds)."""
    out: list[Any] = []
    for i in range(2):
        if name == "kv" or (name == "hybrid" and i == 0):
            c: Any = KVCache()
        elif name == "quantized":
            c = QuantizedKVCache(group_size=32, bits=8)
        elif name == "rotating":
            c = RotatingKVCache(max_size=512, keep=4)
        else:  # the hybrid's recurrent layer: whole state in the tail
            c = ArraysCache(2)
            c[0] = _rand((1, 3, 16), seed + i)
            c[1] = _rand((1, 2, 8, 8), seed + i + 1, mx.float32)
            out.append(c)
            continue
        c.update_and_fetch(_rand((1, H, n, D), seed + i), _rand((1, H, n, D), seed + i + 7))
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def _offset(cache: list[Any]) -> int:
    return next(c.offset for c in cache if hasattr(c, "offset"))


def _edit(cache: list[Any], layer: int, pos: int, width: int, seed: int) -> None:
    """Rewrite positions [pos, pos+width) of one layer in place, as cache-editing code does."""
    c = cache[layer % len(cache)]
    if isinstance(c, ArraysCache):
        c[1] = c[1] + 1  # a recurrent state is replaced, not cut into blocks
        return
    n = _offset(cache)
    lo, hi = min(pos, n - 1), min(pos + width, n)
    arrays = [*c.keys, *c.values] if isinstance(c, QuantizedKVCache) else [c.keys, c.values]
    a = arrays[seed % len(arrays)]
    part = a[..., lo:hi, :]
    a[..., lo:hi, :] = (part + 1).astype(a.dtype) if part.dtype != mx.uint32 else part ^ 1


def _extend(cache: list[Any], n: int, seed: int) -> None:
    for i, c in enumerate(cache):
        if not isinstance(c, ArraysCache):
            c.update_and_fetch(_rand((1, H, n, D), seed + i), _rand((1, H, n, D), seed + i + 3))
        else:
            c[0] = _rand((1, 3, 16), seed)


steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("edit"),
            st.integers(0, 1),
            st.integers(0, 120),
            st.integers(1, 20),
            st.integers(0, 9),
        ),
        st.tuples(st.just("trim"), st.integers(1, 40)),
        st.tuples(st.just("extend"), st.integers(1, 40), st.booleans()),
    ),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(
    family=st.sampled_from(["kv", "quantized", "rotating", "hybrid"]),
    n=st.integers(20, 90),
    plan=steps,
    seed=st.integers(0, 10_000),
    same_store=st.booleans(),
)
# the cases main kept stale, whatever the random draw finds besides
@example(family="kv", n=20, plan=[("edit", 0, 0, 1, 0)], seed=0, same_store=True)
@example(family="quantized", n=40, plan=[("edit", 1, 3, 4, 1)], seed=1, same_store=True)
@example(family="rotating", n=40, plan=[("edit", 0, 17, 2, 0)], seed=2, same_store=True)
@example(family="kv", n=64, plan=[("trim", 30), ("extend", 30, True)], seed=3, same_store=True)
def test_no_stale_block_after_random_edits(
    family: str, n: int, plan: list[tuple[Any, ...]], seed: int, same_store: bool
) -> None:
    cache = _family(family, n, seed)
    toks = tokens_for(n, seed=seed)
    ident = Q_IDENT if family == "quantized" else IDENT
    trimmable = family != "hybrid"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "s"
        store = persist.Store(root, block_tokens=BLOCK)
        try:
            store.save(cache, toks, identity=ident, session="x")
            for j, step in enumerate(plan):
                if step[0] == "edit":
                    _edit(cache, step[1], step[2], step[3], seed + j)
                elif step[0] == "trim" and trimmable:
                    k = min(step[1], len(toks) - 1)
                    for c in cache:
                        c.trim(k)
                    toks = toks[: len(toks) - k]
                elif step[0] == "extend":
                    # the same tokens again after a trim (other bytes), or new ones
                    more = tokens_for(step[1], seed=seed if step[2] else seed + j + 1)
                    _extend(cache, step[1], seed + 100 * j)
                    toks = [*toks, *more]
                mx.eval([c.state for c in cache])
                if not same_store:  # the README's idiom: a Store per turn
                    store.close()
                    store = persist.Store(root, block_tokens=BLOCK)
                store.save(cache, toks, identity=ident, session="x")
                with persist.Store(root, block_tokens=BLOCK) as fresh:
                    got = fresh.restore("x", identity=ident)
                    assert got.tokens == toks
                    assert_same_state(live_state(got.cache), live_state(cache))
        finally:
            store.close()
