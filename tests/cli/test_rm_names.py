"""Attack 38b, finding 4: a session name is a name.  ``persist rm 'notes[1]'`` deleted
``notes1`` (the name was taken as a glob pattern), locally and with ``--fleet`` on
every tier; ``persist rm 'todo[x]'`` could not delete ``todo[x]`` at all.  Patterns
are taken only behind ``--glob``, expand over this store's sessions only, and ``rm``
names what it deletes.  Real stores, real ``persist`` processes, a real redis-server.
"""

from __future__ import annotations

import json
from pathlib import Path

import persist
from tests.helpers import persist_cli
from tests.store_helpers import saved_sessions, sessions_left

ODD = ["notes[1]", "notes1", "todo[x]", "draft*", "draft-final", "q?", "qa"]


def test_rm_takes_a_name_with_glob_characters_as_that_name(tmp_path: Path) -> None:
    root = tmp_path / "s"
    saved_sessions(root, *ODD)
    for name in ("notes[1]", "todo[x]", "draft*", "q?"):
        out = persist_cli(tmp_path, "rm", name, "--store", str(root), check=False)
        assert (out.returncode, out.stdout.strip()) == (0, f"deleted session {name!r}"), out
    assert sessions_left(root) == ["draft-final", "notes1", "qa"]


def test_a_pattern_only_behind_glob_and_rm_names_what_it_matched(tmp_path: Path) -> None:
    root = tmp_path / "s"
    saved_sessions(root, "draft-1", "draft-2", "keep")
    out = persist_cli(tmp_path, "rm", "draft-*", "--store", str(root), check=False)
    assert out.returncode == 1 and "no session 'draft-*'" in out.stderr, out
    assert "--glob" in out.stderr  # says how to ask for a pattern
    assert sessions_left(root) == ["draft-1", "draft-2", "keep"]
    out = persist_cli(tmp_path, "rm", "--glob", "draft-*", "--store", str(root), "--json")
    got = json.loads(out.stdout)
    assert got["deleted"] == ["draft-1", "draft-2"] and got["matched"] == {
        "draft-*": ["draft-1", "draft-2"]
    }
    assert sessions_left(root) == ["keep"]


def test_other_commands_take_names_as_given(tmp_path: Path) -> None:
    root = tmp_path / "s"
    saved_sessions(root, "notes[1]", "notes1")
    persist_cli(tmp_path, "pin", "notes[1]", "--store", str(root))
    with persist.Store(root) as s:
        pinned = {str(e.session): e.pinned for e in s.sessions()}
    assert pinned == {"notes[1]": True, "notes1": False}
    out = persist_cli(tmp_path, "ls", "--prefix", "notes[", "--store", str(root), "--json")
    assert [e["session"] for e in json.loads(out.stdout)] == ["notes[1]"]
    out = persist_cli(tmp_path, "show", "notes[1]", "--store", str(root), "--json")
    assert json.loads(out.stdout)["session"] == "notes[1]"
    persist_cli(tmp_path, "export", "notes[1]", str(tmp_path / "n.persist"), "--store", str(root))
    with persist.Store(tmp_path / "t") as t:
        got = t.import_file(tmp_path / "n.persist", session="x")
    assert got.tokens == 16 and sessions_left(root) == ["notes1", "notes[1]"]
