"""A fleet: three machines (separate processes and roots) on one shared tier, and the
shared tier as a real three-node Redis Cluster (``redis+cluster://``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import check_against_child, prefill, run_child, tokens_for
from tests.tiers.conftest import Clock

TURN = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3


def three_machines(model: Any, tok: Any, model_dir: Path, url: str, tmp: Path) -> None:
    """A saves a session; B (a process) restores it, continues it and saves the next
    turn; C (another process) looks the longer prompt up: every step bit for bit."""
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=40)
    with persist.Store(tmp / "a", shared=url) as a:
        a.save(prefill(model, toks)[0], toks, identity=ident, session="chat")
    with persist.Store(tmp / "b", shared=url) as b:  # machine B, its own empty root
        got = b.restore("chat", identity=ident)
        assert got.tokens == toks
        cache, _ = prefill(model, TURN, cache=got.cache)
        b.save(cache, [*toks, *TURN], identity=ident, session="chat", if_version=got.entry.id)
    longer = [*toks, *TURN]
    out = tmp / "c.safetensors"
    job = {"store": str(tmp / "c"), "shared": url, "lookup": [*longer, 99, 98]}
    run_child(model_dir, [{**job, "next": [7], "out": str(out)}], tmp)
    want, _ = prefill(model, toks)  # what C holds: exactly B's turn, computed here again
    want, _ = prefill(model, TURN, cache=want)
    check_against_child(model, want, out, longer, next_tokens=[7])
    with persist.Store(tmp / "a", shared=url) as a:  # and A sees B's turn of its session
        assert a.has_session("chat")
        a.delete("chat")  # A's local copy: the tier's is newer
        assert a.restore("chat", identity=ident).tokens == longer


def test_three_machines_continue_each_others_work(
    tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    model, tok, model_dir = tiny("llama")
    three_machines(model, tok, model_dir, redis_server.url, tmp_path)


@pytest.mark.long
def test_a_redis_cluster_is_a_shared_tier(tiny: Any, redis_cluster: Any, tmp_path: Path) -> None:
    model, tok, model_dir = tiny("llama")
    three_machines(model, tok, model_dir, redis_cluster.url, tmp_path)
    # the keys of one namespace spread over the nodes (no hash tag pins them to one slot)
    held = [n.client().dbsize() for n in redis_cluster.nodes]
    assert sum(1 for k in held if k) >= 2, held


def test_a_cluster_that_is_down_costs_a_bounded_wait(
    tiny: Any, redis_cluster: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=41)
    cache = prefill(model, toks)[0]
    with persist.Store(tmp_path / "a", shared=redis_cluster.url) as a:
        a.save(cache, toks, identity=ident, session="one")
        Clock(a)  # stopped: however slow this machine, all that follows is in one window
        redis_cluster.stop()
        a.save(cache, toks, identity=ident, session="two")  # the local save stands
        assert a.lookup([*toks, 1], identity=ident) is not None
        assert a.restore("two", identity=ident).tokens == toks
        assert a.shared is not None
        counters = a.shared.tier.counters  # one failed call (its timeouts), then the breaker
        assert counters.get("errors", 0) == 1 and counters.get("skipped", 0) >= 1, counters
        assert a.stats().counters.get("shared_errors", 0) >= 1


def test_cluster_urls_are_checked() -> None:
    from persist.remote.redis_tier import RedisTier, cluster_client

    with pytest.raises(persist.InvalidArgumentError, match="host:port"):
        cluster_client("redis+cluster://127.0.0.1", {})
    assert RedisTier("valkey+cluster://u:p@127.0.0.1:1,127.0.0.1:2").cluster


@pytest.mark.long
@pytest.mark.parametrize("shared", [40, 300])
def test_a_prefix_that_ends_inside_a_block_serves_another_machine(
    shared: int, tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """Token-exact across machines as on one: a prompt that shares 40 tokens (less than
    a block) or 300 (a block and 44) with a snapshot another machine saved."""
    model, tok, model_dir = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    stored = tokens_for(600, seed=42)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        a.save(prefill(model, stored)[0], stored, identity=ident)
    prompt = [*stored[:shared], (stored[shared] + 1) % 256, 4, 4]
    out = tmp_path / "out.safetensors"
    job = {"store": str(tmp_path / "b"), "shared": redis_server.url, "lookup": prompt}
    run_child(model_dir, [{**job, "next": [8], "out": str(out)}], tmp_path)
    want, _ = prefill(model, stored[:shared])
    check_against_child(model, want, out, stored[:shared], next_tokens=[8])


@pytest.mark.long
@pytest.mark.parametrize("shared,hit", [(300, 256), (400, 384), (120, 0)])
def test_recurrent_checkpoints_serve_other_machines(
    shared: int, hit: int, tiny: Any, redis_server: Any, tmp_path: Path
) -> None:
    """A hybrid (gated-DeltaNet) model primed with checkpoints on one machine: another
    machine's prompt resumes from the deepest checkpoint it holds all the tokens of,
    bit for bit, and never from the longer session it cannot trim."""
    model, tok, model_dir = tiny("qwen3_next")
    ident = persist.ModelIdentity.of(model, tok)
    doc = tokens_for(600, seed=43)
    with persist.Store(tmp_path / "a", shared=redis_server.url) as a:
        cache = persist.prefill(
            model, doc, store=a, identity=ident, session="doc", checkpoint_every=128
        )
        a.save(cache, doc, identity=ident, session="doc")
    prompt = [*doc[:shared], (doc[shared] + 1) % 256, 4, 4]
    if not hit:  # less than the first checkpoint (128)? 120 shares no checkpoint
        with persist.Store(tmp_path / "b", shared=redis_server.url) as b:
            assert b.lookup(prompt, identity=ident) is None
        return
    out = tmp_path / "out.safetensors"
    job = {"store": str(tmp_path / "b"), "shared": redis_server.url, "lookup": prompt}
    run_child(model_dir, [{**job, "next": [8], "out": str(out)}], tmp_path)
    want = persist.prefill(model, doc[:hit], step=128)  # the same forwards as the prime
    check_against_child(model, want, out, doc[:hit], next_tokens=[8])
