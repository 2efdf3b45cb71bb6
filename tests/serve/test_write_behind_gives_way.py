"""The write-behind gives way to requests in their prompt phase (issue 39): a save's
copies and writes wait while a request waits for its first token, a bounded time
per cache.  Real tiny models, a real store, a real batch loop; no timing asserted:
who waits where is read from the gate's own counts."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx_lm.server as server
from mlx_lm.models.cache import LRUPromptCache

import persist
from persist.serve.generation import GuardedGenerator
from persist.serve.quiet import RequestGate
from persist.serve.server import PersistentPromptCache
from persist.yielding import giving_way, pause
from tests.helpers import prefill, tokens_for
from tests.serve.generators import cli_args, request


def test_pause_waits_while_a_request_prompts_and_not_after() -> None:
    gate = RequestGate(hold=3600)
    assert gate.pauses()() is None  # nobody prompts: no wait at all
    prompted = gate.enter()
    done = threading.Event()

    def background() -> None:
        with giving_way(gate.pauses()):
            pause()
        done.set()

    t = threading.Thread(target=background)
    t.start()
    assert gate.wait_for_waiters(1, timeout=60)
    assert not done.is_set()
    prompted()
    prompted()  # said twice: counted once
    t.join(60)
    assert done.is_set() and gate.prompting == 0 and gate.waited > 0


def test_a_cache_waits_at_most_its_hold_in_all() -> None:
    now = [0.0]

    def clock() -> float:  # each reading is 0.6 s later: the hold runs out on the 2nd
        now[0] += 0.6
        return now[0]

    gate = RequestGate(hold=1.0, clock=clock)
    gate.enter()  # a request that never gets its first token
    waits = gate.pauses()
    waits()
    assert gate.waited >= 1.0
    before = gate.waited
    waits()  # its hold is spent: it goes on though the request still prompts
    assert gate.waited == before and gate.prompting == 1


def test_pause_outside_background_work_does_nothing() -> None:
    gate = RequestGate(hold=3600)
    gate.enter()
    pause()  # this thread gives way to nobody
    assert gate.waiting == 0


def test_the_write_behind_saves_once_the_prompt_phase_ends(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(80, seed=93)
    gate = RequestGate(hold=3600)
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident, gate=gate)
        try:
            prompted = gate.enter()  # the next request is prefilling
            pc.insert_cache("m", toks, prefill(model, toks)[0])
            assert gate.wait_for_waiters(1, timeout=60)
            assert store.entries() == []  # held before its capture, nothing written
            prompted()
            pc.flush()
            assert [e.tokens for e in store.entries()] == [80]
        finally:
            pc.close()


def test_a_request_prompts_until_its_first_token(model_dir: Any) -> None:
    gate = RequestGate(hold=3600)
    gen_class = type("Gated", (GuardedGenerator,), {"gate": gate})
    provider = server.ModelProvider(cli_args(str(model_dir("llama"))))
    gen = gen_class(provider, LRUPromptCache())
    try:
        _ctx, responses = gen.generate(*request("hello there, how are"))
        first = next(responses)
        assert first.text is not None and gate.prompting == 0
        assert list(responses) is not None and gate.prompting == 0
        _ctx, unread = gen.generate(*request("hello again"))
        assert gate.prompting == 1  # its handler has not read a token yet
        del unread  # a handler that goes away without reading: not counted for good
        assert gate.prompting == 0
    finally:
        gen.stop_and_join()
