"""Attack 38d, finding E: a session of the longest name (1024 characters) whose turn
lost a race was kept as ``NAME~2``, 1026 characters, which no command then took (or
the save failed): every name persist keeps a history under is one every command
takes.  A fork suffix ``~N`` (2 <= N <= 1000) may take a session name past the limit,
which is the base name's; a fork of such a name goes beside it (``NAME~3``), never
``NAME~2~2``.  The race through the library (real store), then real ``persist``
processes on what it kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.apps import generate as gen_mod
from tests.helpers import persist_cli

LONGEST = "L" * 1024  # persist.storage.rows.MAX_NAME


def lost_a_race(monkeypatch: pytest.MonkeyPatch, store: persist.Store, ident: Any) -> None:
    """Every turn from here on loses a race: another writer saves the session after it
    was read."""
    real = gen_mod.resume_text

    def racing(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        session = a[1]  # resume_text(store, session, ...)
        other = store.restore(session, identity=ident)
        store.save(other.cache, other.tokens, identity=ident, session=session)
        return got

    monkeypatch.setattr(gen_mod, "resume_text", racing)


def test_a_turn_kept_beside_the_longest_name_is_taken_by_every_command(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, folder = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    root = tmp_path / "s"
    with persist.Store(root) as store:
        gen_mod.generate(model, tok, ident, store, session=LONGEST, prompt="hi", max_tokens=2)
        lost_a_race(monkeypatch, store, ident)
        r = gen_mod.generate(model, tok, ident, store, session=LONGEST, prompt="on", max_tokens=2)
        assert (r.session, r.conflict_with) == (f"{LONGEST}~2", LONGEST)
        fork = r.session  # 1026 characters
        r = gen_mod.generate(model, tok, ident, store, session=fork, prompt="and", max_tokens=2)
        assert r.session == f"{LONGEST}~3"  # beside it, never NAME~2~2
    monkeypatch.undo()
    at = ("--store", str(root))
    for name in (fork, f"{LONGEST}~3"):
        shown = json.loads(persist_cli(tmp_path, "show", name, *at, "--json").stdout)
        assert shown["session"] == name
    persist_cli(tmp_path, "pin", fork, *at)
    out = persist_cli(
        tmp_path, "generate", "--model", str(folder), "--session", fork, "--prompt", "more",
        "--max-tokens", "2", *at, "--json",
    )  # fmt: skip
    got = json.loads(out.stdout)
    assert got["session"] == fork and got["reused_tokens"] > 0
    file = tmp_path / "fork.persist"
    persist_cli(tmp_path, "export", fork, str(file), *at)
    persist_cli(tmp_path, "import", str(file), "--session", f"{LONGEST}~1000", *at)
    out = persist_cli(tmp_path, "rm", fork, f"{LONGEST}~1000", *at, "--json")
    assert json.loads(out.stdout)["deleted"] == [fork, f"{LONGEST}~1000"]


@pytest.mark.parametrize(
    "name",
    [f"{LONGEST}~1001", f"{LONGEST}~1", f"{LONGEST}~02", f"{LONGEST}~2~2", "L" * 1025],
    ids=["past-1000", "one", "zero", "twice", "no-suffix"],
)
def test_past_the_limit_only_a_fork_suffix(tmp_path: Path, name: str) -> None:
    persist.Store(tmp_path / "s").close()
    out = persist_cli(tmp_path, "pin", name, "--store", str(tmp_path / "s"), check=False)
    assert out.returncode == 1 and "session must be 1 to 1024 characters" in out.stderr, out
    assert "fork suffix" in out.stderr
