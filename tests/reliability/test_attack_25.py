"""Round-3 outside attack on fault handling: what broke, each with its test.

1. An index row whose column holds a value of the wrong SQLite type (text in a
   BLOB column, text in a number column: what a damaged or hand-edited index
   holds, SQLite does not enforce column types) made ``ls``, ``stats``,
   ``show``, ``check`` and ``check --fix`` exit 3 with a TypeError traceback.
2. The same in the other tables: text in ``blobs.head_xxh3`` or
   ``snapshot_blocks.chain`` made ``check`` exit 3; a block size in ``meta``
   that is not a number made every command exit 3 (ValueError); a namespace
   secret of the wrong type must be refused, never read as an empty key.
3. click's own usage errors printed an argument raw (``persist ls $'n\x1b]0;..'``
   gave "Got unexpected extra argument (n<ESC>]0;..)" on the terminal).
4. ``tmp/`` or ``blobs/`` replaced by a regular file was reported as "is not a
   regular file, not a folder": the opposite of what it is.
5. A FIFO or folder in place of the ``reserve`` file: ``check`` said the store
   was consistent, and the full-disk path (which frees only a regular
   reserve) had nothing to free, so ``rm``/``gc`` lost their room to delete.
6. A row whose token count was changed (bit rot in a column the row checksum
   covers): ``persist show`` printed "tokens 200" for a 300-token session,
   unmarked, though ``check`` calls the row damaged; ``persist ls`` the same.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from mlx_lm.models import cache as mc

import persist
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import persist_cli


def saved(root: Path, names: tuple[str, ...] = ("keep", "other"), n: int = 300) -> None:
    for seed, name in enumerate(names, 1):
        c = mc.KVCache()
        c.update_and_fetch(*kvs(seed, n))
        with persist.Store(root) as s:
            s.save([c], list(range(n)), identity=IDENTITY, session=name)


def edit(root: Path, sql: str) -> None:
    db = sqlite3.connect(root / "index.sqlite")
    with db:
        db.execute(sql)
    db.close()


def typed(out: subprocess.CompletedProcess[str]) -> None:
    text = out.stdout + out.stderr
    assert out.returncode in (0, 1), text
    assert "Traceback" not in text, text


@pytest.mark.parametrize(
    "change",
    [
        "manifest = 'hello'",
        "tokens = 'abc'",
        "identity_map = 'x'",
        "metadata = 7",
        "bytes = 'x'",
        "created = 'zz'",
        "used = x'00'",
        "n_tokens = 'abc'",
    ],
)
def test_a_row_with_a_wrongly_typed_column_is_damage_not_a_crash(
    tmp_path: Path, change: str
) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, f"UPDATE snapshots SET {change} WHERE name = 'keep'")
    for args in (["ls"], ["ls", "--json"], ["stats"], ["show", "keep"], ["check"]):
        typed(persist_cli(root, *args, check=False))
    typed(persist_cli(root, "check", "--fix", check=False))
    typed(persist_cli(root, "ls", check=False))
    with persist.Store(root) as s:  # the undamaged session is untouched
        assert s.restore("other", identity=IDENTITY).tokens == list(range(300))


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE blobs SET head_xxh3 = 'x' WHERE rowid = 1",
        "UPDATE snapshot_blocks SET chain = 'x'",
        "UPDATE meta SET value = 'abc' WHERE key = 'block_tokens'",
        "UPDATE namespaces SET secret = 'x'",
    ],
)
def test_other_tables_with_a_wrongly_typed_column_are_typed_damage(
    tmp_path: Path, change: str
) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, change)
    for args in (["ls"], ["stats"], ["show", "keep"], ["check"], ["check", "--fix"], ["ls"]):
        typed(persist_cli(root, *args, check=False))
    try:
        with persist.Store(root) as s:
            s.restore("other", identity=IDENTITY)
    except persist.PersistError:
        pass  # typed: refused, or restored; never a raw TypeError or a keyless secret


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "n\x1b]0;forged\x07"],  # an extra argument: click's own usage error
        ["show", "a", "b\x1b[2J"],
        ["ls", "--bogus\x1b[2J\r"],
        ["--bogus\x1b[2J\u202e"],
    ],
)
def test_usage_errors_escape_control_characters(tmp_path: Path, args: list[str]) -> None:
    out = persist_cli(tmp_path / "store", *args, check=False)
    assert out.returncode == 2, out.stderr
    assert not any(c in out.stdout + out.stderr for c in "\x1b\x07\r\u202e"), out.stderr


@pytest.mark.parametrize("folder", ["tmp", "blobs"])
def test_a_folder_replaced_by_a_file_is_named_a_regular_file(tmp_path: Path, folder: str) -> None:
    root = tmp_path / "store"
    saved(root, ("keep",))
    target = root / folder
    if folder == "tmp":
        target.rmdir()
    else:
        shutil.rmtree(target)
    target.write_text("x")
    out = persist_cli(root, "check", check=False)
    assert out.returncode == 1, out.stderr
    assert f"{folder}: is a regular file, not a folder" in out.stdout, out.stdout


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_an_odd_file_in_place_of_the_reserve_is_reported_and_replaced(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "store"
    saved(root, ("keep",))
    reserve = root / "reserve"
    reserve.unlink()
    os.mkfifo(reserve) if kind == "fifo" else reserve.mkdir()
    out = persist_cli(root, "check", check=False)
    assert out.returncode == 1 and "reserve" in out.stdout, out.stdout
    typed(persist_cli(root, "check", "--fix", check=False))
    assert reserve.is_file() and not reserve.is_symlink() and reserve.stat().st_size > 0
    assert persist_cli(root, "check").returncode == 0


def test_show_marks_a_row_that_fails_its_checksum(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, "UPDATE snapshots SET n_tokens = 200 WHERE name = 'keep'")
    out = persist_cli(root, "show", "keep")
    assert "DAMAGED" in out.stdout and "checksum" in out.stdout, out.stdout
    data = json.loads(persist_cli(root, "show", "keep", "--json").stdout)
    assert data["damaged"], data
    assert "DAMAGED" not in persist_cli(root, "show", "other").stdout


def test_ls_marks_a_row_that_fails_its_checksum(tmp_path: Path) -> None:
    root = tmp_path / "store"
    saved(root)
    edit(root, "UPDATE snapshots SET n_tokens = 200 WHERE name = 'keep'")
    lines = persist_cli(root, "ls").stdout.splitlines()
    assert [ln for ln in lines if "DAMAGED" in ln and " keep " in ln], lines
    assert not [ln for ln in lines if "DAMAGED" in ln and " other " in ln], lines
    data = json.loads(persist_cli(root, "ls", "--json").stdout)
    assert [e["session"] for e in data if e["damaged"]] == ["keep"], data
