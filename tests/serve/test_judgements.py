"""A lookup's verdict reads the store as the lookup saw it (serve.judgements)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import persist
from persist.serve.judgements import Judgements
from persist.yielding import committing
from tests.helpers import prefill, tokens_for


def test_a_save_commits_only_after_the_verdicts_of_open_lookups(tiny: Any, tmp_path: Path) -> None:
    # a save that reaches its commit while a lookup is open waits for that lookup's
    # verdict: judged after the commit, a miss of these tokens would read as a hit
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(48, seed=101)
    cache = prefill(model, toks)[0]
    j = Judgements()
    seen: list[bool] = []
    with persist.Store(tmp_path / "s") as store:

        def save() -> None:
            with committing(j.before_commit):
                store.save(cache, toks, identity=ident)

        writer = threading.Thread(target=save)
        with j.looking() as hand:
            writer.start()
            assert j.wait_for_holding(1, 60)  # at its commit, held by this lookup
            assert store.lookup([*toks, 1], identity=ident) is None
            hand(lambda: seen.append(store.lookup([*toks, 1], identity=ident) is None))
        writer.join(60)
        assert not writer.is_alive()
        assert seen == [True]  # judged before the save committed
        assert store.lookup([*toks, 1], identity=ident) is not None


def test_a_lookup_open_past_the_bound_loses_its_verdict_not_the_save() -> None:
    ticks = iter(range(0, 1000, 10))  # each reading of the clock 10 s later
    j = Judgements(bound=5.0, clock=lambda: float(next(ticks)))
    ran: list[int] = []
    with j.looking() as hand:
        hand(lambda: ran.append(1))  # handed over, but its lookup is still open
        j.before_commit()  # its wait is over at once: the save commits
        j.after_commit()
    j.run_ready()
    assert ran == [] and j.dropped == 1
    with j.looking() as hand:  # a later lookup is judged as usual
        hand(lambda: ran.append(2))
    assert j.wake() and not j.wake()  # one wake-up per run of ready verdicts
    j.before_commit()
    j.after_commit()
    assert ran == [2]


def test_a_lookup_never_begins_inside_a_commit(tiny: Any, tmp_path: Path, monkeypatch: Any) -> None:
    # attack r14, A2: a lookup that began after the save's wait for open lookups and
    # before its commit read the store without the save, and was judged after it
    from persist.engine import saving

    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(48, seed=105)
    cache = prefill(model, toks)[0]
    j = Judgements()
    in_window, go, entered = threading.Event(), threading.Event(), threading.Event()
    real = saving._commit

    def held_commit(*args: Any, **kw: Any) -> Any:
        in_window.set()  # past before_commit, not yet committed
        assert go.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(saving, "_commit", held_commit)
    seen: list[bool] = []
    with persist.Store(tmp_path / "s") as store:

        def save() -> None:
            with committing(j.before_commit, j.after_commit):
                store.save(cache, toks, identity=ident)

        def lookup() -> None:
            with j.looking():
                entered.set()
                seen.append(store.lookup([*toks, 1], identity=ident) is not None)

        writer = threading.Thread(target=save)
        writer.start()
        assert in_window.wait(60)
        looker = threading.Thread(target=lookup)
        looker.start()
        assert not entered.wait(0.5)  # it waits for the commit to end
        go.set()
        writer.join(60)
        looker.join(60)
        assert seen == [True]  # it began after the commit: the store it judges
