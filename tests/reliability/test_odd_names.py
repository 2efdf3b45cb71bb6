"""Damaged index rows, names with control characters, odd paths, headers that are not JSON.

Round 3: bit rot in a row's manifest made ``persist ls`` and ``persist show``
exit 3; a session name carrying CR, OSC and CSI sequences was printed raw by
``persist ls`` (a tenant could forge an operator's terminal line); a store
path with a 300-byte folder name exited 3; a header that was not JSON was
reported as nesting too deep.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import persist_cli

EVIL = "evil\r\x1b]0;owned\x07\x1b[2J\x1b[31mroot\u202e\x9b"


def saved(root: Path, *names: str) -> None:
    with persist.Store(root) as s:
        for i, name in enumerate(names):
            c = mc.KVCache()
            c.update_and_fetch(*kvs(i + 1, 40))
            s.save([c], list(range(40)), identity=IDENTITY, session=name)


@pytest.mark.parametrize("column", ["manifest", "identity_map"])
def test_listing_shows_a_damaged_row_and_goes_on(tmp_path: Path, column: str) -> None:
    root = tmp_path / "store"
    saved(root, "a", "b")
    db = sqlite3.connect(root / "index.sqlite")
    with db:
        db.execute(f"UPDATE snapshots SET {column} = X'c1c1c1c1' WHERE name = 'a'")
    db.close()
    out = persist_cli(root, "ls")
    lines = out.stdout.splitlines()
    assert "DAMAGED" in next(x for x in lines if " a " in x) and "DAMAGED" not in lines[-1], lines
    got = json.loads(persist_cli(root, "ls", "--json").stdout)
    assert [e["damaged"] is not None for e in got] == [True, False]
    out = persist_cli(root, "show", "a")
    assert "DAMAGED" in out.stdout and "check --fix" in out.stdout
    assert "DAMAGED" not in persist_cli(root, "show", "b").stdout
    out = persist_cli(root, "check", check=False)
    assert out.returncode == 1 and "damaged-row: session 'a'" in out.stdout, out
    persist_cli(root, "check", "--fix")
    assert [e["session"] for e in json.loads(persist_cli(root, "ls", "--json").stdout)] == ["b"]


def test_a_flipped_byte_in_a_text_column_is_listed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root, "a", "b")
    db = sqlite3.connect(root / "index.sqlite")
    with db:
        db.execute("UPDATE snapshots SET name = CAST(X'61ff' AS TEXT) WHERE name = 'a'")
    db.close()
    out = persist_cli(root, "ls")
    assert "a\ufffd" in out.stdout and " b " in out.stdout, out


def test_control_characters_are_escaped_in_every_human_readable_line(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root, EVIL)
    outputs = [
        persist_cli(root, "ls").stdout,
        persist_cli(root, "ls", "--all").stdout,
        persist_cli(root, "show", EVIL).stdout,
        persist_cli(root, "gc", "--max-bytes", "0", "--dry-run").stdout,
        persist_cli(root, "show", EVIL + "x", check=False).stderr,
    ]
    for text in outputs:
        assert not any(c in text for c in "\r\x1b\x07\x9b\u202e"), repr(text)
        assert "\\x1b" in text, repr(text)
    names = [e["session"] for e in json.loads(persist_cli(root, "ls", "--json").stdout)]
    assert names == [EVIL]  # scripts get the exact name
    assert persist_cli(root, "rm", EVIL).returncode == 0


@pytest.mark.parametrize("how", ["--store", "PERSIST_HOME"])
def test_a_folder_name_longer_than_255_bytes_is_refused_typed(tmp_path: Path, how: str) -> None:
    long = tmp_path / ("x" * 300) / "store"
    if how == "--store":
        out = persist_cli(tmp_path, "ls", "--store", str(long), check=False)
    else:
        out = persist_cli(long, "ls", check=False)
    assert out.returncode == 1 and "at most 255" in out.stderr, out
    with pytest.raises(persist.InvalidNameError, match="300 bytes"):
        persist.Store(long)


@pytest.mark.parametrize(
    "body", [b"\xff\xfe\x00garbage{{[", b"{not json at all]]]", b"hello there, world"]
)
def test_a_header_that_is_not_json_is_reported_as_not_json(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(persist.CorruptBlobError, match="not JSON"):
        persist.load_file(path)
    out = persist_cli(tmp_path / "store", "inspect", str(path), check=False)
    assert out.returncode == 1 and "not JSON" in out.stderr, out


BAD = "\ud800"  # a lone surrogate: what a shell's invalid UTF-8 becomes in argv
CALLS = {
    "entry": lambda s, c, t: s.entry("a", namespace=BAD),
    "entry (name)": lambda s, c, t: s.entry(BAD),
    "pin": lambda s, c, t: s.pin("a", namespace=BAD),
    "retain": lambda s, c, t: s.retain("a", ttl=60, namespace=BAD),
    "retention": lambda s, c, t: s.retention("a", namespace=BAD),
    "delete": lambda s, c, t: s.delete("a", namespace=BAD),
    "has_session": lambda s, c, t: s.has_session("a", namespace=BAD),
    "sessions": lambda s, c, t: list(s.sessions(namespace=BAD)),
    "entries": lambda s, c, t: list(s.entries(namespace=BAD)),
    "count": lambda s, c, t: s.count(namespace=BAD, lookups=1),
    "stats": lambda s, c, t: s.stats(namespace=BAD),
    "restore": lambda s, c, t: s.restore("a", identity=IDENTITY, namespace=BAD),
    "export": lambda s, c, t: s.export("a", t, namespace=BAD),
    "save": lambda s, c, t: s.save(c, list(range(40)), identity=IDENTITY, namespace=BAD),
    "lookup": lambda s, c, t: s.lookup(list(range(40)), identity=IDENTITY, namespace=BAD),
    "find": lambda s, c, t: s.find(list(range(40)), identity=IDENTITY, namespace=BAD),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_namespace_that_is_not_text_is_a_typed_error(tmp_path: Path, call: str) -> None:
    """Outside attack r15, F4: a namespace holding a lone surrogate reached SQLite
    unchecked in pin, retain, delete and entry (an untyped UnicodeEncodeError:
    `persist rm s --namespace $'\\xff'` exited 3, "a bug in persist")."""
    root = tmp_path / "store"
    saved(root, "a")
    c = mc.KVCache()
    c.update_and_fetch(*kvs(1, 40))
    with persist.Store(root) as s:
        with pytest.raises(persist.errors.InvalidNameError):
            CALLS[call](s, [c], tmp_path / "out.persist")
        assert [e.session for e in s.sessions()] == ["a"]  # nothing lost
        assert s.check() == []


@pytest.mark.parametrize(
    "args", [["rm", "s"], ["show", "s"], ["ls"], ["pin", "s"], ["stats"]], ids=" ".join
)
def test_invalid_utf8_in_a_namespace_argument_exits_1(tmp_path: Path, args: list[str]) -> None:
    import os
    import subprocess
    import sys

    from tests.helpers import pythonpath

    saved(tmp_path / "store", "s")
    out = subprocess.run(
        [sys.executable, "-m", "persist", *args, "--namespace", b"\xff"],
        env={**os.environ, "PERSIST_HOME": str(tmp_path / "store"), "PYTHONPATH": pythonpath()},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1 and "namespace must be valid text" in out.stderr, out
