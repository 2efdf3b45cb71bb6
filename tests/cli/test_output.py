"""What the commands print: JSON errors for scripts, a chat's messages in show,
singular and plural, session names completed by the shell."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from mlx_lm.models import cache as mc

import persist
from persist.apps.resume import CHAT_KEY
from persist.cli import cli
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import ROOT, persist_cli


def made(root: Path, *names: str, metadata: dict[str, str] | None = None) -> str:
    with persist.Store(root) as s:
        for i, name in enumerate(names):
            c = mc.KVCache()
            c.update_and_fetch(*kvs(3 + i, 20))
            s.save([c], [i + 1] * 20, identity=IDENTITY, session=name, metadata=metadata)
    return str(root)


@pytest.mark.parametrize(
    ("args", "kind", "code"),
    [
        (["show", "nope"], "SessionNotFoundError", 1),
        (["rm", "nope"], "SessionNotFoundError", 1),
        (["gc", "--max-bytes", "lots"], "BadParameter", 2),
        (["ls", "--bogus"], "NoSuchOption", 2),
    ],
)
def test_errors_under_json_are_json(tmp_path: Path, args: list[str], kind: str, code: int) -> None:
    root = made(tmp_path / "s", "w")
    res = CliRunner().invoke(cli, [*args, "--store", root, "--json"])
    assert res.exit_code == code
    got = json.loads(res.stdout)
    assert got["type"] == kind and got["exit"] == code and got["error"], got
    missing = CliRunner().invoke(cli, ["ls", "--store", str(tmp_path / "typo"), "--json"])
    assert json.loads(missing.stdout)["type"] == "StoreNotFoundError"


def test_show_shows_a_chats_messages(tmp_path: Path) -> None:
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello."},
    ]
    root = made(tmp_path / "s", "c1", metadata={CHAT_KEY: json.dumps(chat)})
    out = CliRunner().invoke(cli, ["show", "c1", "--store", root]).stdout
    assert "chat               3 messages" in out
    assert "    user      Hi\\nthere" in out  # one line per message
    assert "    assistant Hello." in out
    got = json.loads(CliRunner().invoke(cli, ["show", "c1", "--store", root, "--json"]).stdout)
    assert got["chat"] == chat


def test_one_is_singular(tmp_path: Path) -> None:
    root = made(tmp_path / "s", "only")
    out = CliRunner().invoke(cli, ["stats", "--store", root]).stdout
    assert out.startswith("1 entry (1 session); ")
    gc = CliRunner().invoke(cli, ["gc", "--max-bytes", "0", "--store", root]).stdout
    assert gc.startswith("evicted 1 entry, ")


def complete(env: dict[str, str], words: str) -> list[str]:
    """What bash completion offers after ``words`` (click's bash_complete protocol)."""
    cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
    e = {**env, "_PERSIST_COMPLETE": "bash_complete", "COMP_WORDS": words, "COMP_CWORD": cword}
    out = subprocess.run(
        [sys.executable, "-m", "persist"], env=e, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return [line.split(",", 1)[1] for line in out.stdout.splitlines() if line.startswith("plain,")]


def test_the_shell_completes_session_names(tmp_path: Path) -> Any:
    home = tmp_path / "home"
    made(home, "work-a", "work-b", "other")
    env = {**os.environ, "PERSIST_HOME": str(home), "PYTHONPATH": str(ROOT)}
    assert complete(env, "persist show work") == ["work-a", "work-b"]
    assert complete(env, "persist rm ") == ["other", "work-a", "work-b"]
    assert complete(env, "persist generate --session o") == ["other"]
    typo = {**env, "PERSIST_HOME": str(tmp_path / "none")}
    assert complete(typo, "persist show w") == [] and not (tmp_path / "none").exists()


def test_every_command_is_where_the_lazy_group_looks() -> None:
    """A command loads only its module (app.COMMANDS): each command must be named there."""
    from persist.cli.app import COMMANDS, load_commands

    load_commands()
    assert set(cli.commands) == set(COMMANDS)


def test_long_names_keep_the_columns(tmp_path: Path) -> None:
    root = made(tmp_path / "s", "short", "a-session-name-far-longer-than-its-column-is-wide")
    out = CliRunner().invoke(cli, ["ls", "--store", root]).stdout.splitlines()
    assert "a-session-name-far-longer-than-its-column-is-wide" in out[0]  # whole, own line
    data = [line for line in out if " tok " in line]
    assert len(data) == 2 and len({line.index(" tok ") for line in data}) == 1, out
    assert len({line.index(" used ") for line in data}) == 1, out


def test_a_huge_limit_lists_everything_not_a_traceback(tmp_path: Path) -> None:
    """``ls --limit 2**63`` overflowed SQLite's integer (found by an attack on the
    listing commands): past sys.maxsize a limit is every row."""
    root = made(tmp_path / "s", "w")
    r = CliRunner().invoke(cli, ["ls", "--limit", str(2**63), "--store", root])
    assert r.exit_code == 0, r.output
    assert "w" in r.output.split()


# click's own usage errors printed an argument raw: escape sequences reached the terminal
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


def every_command(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every command under ``group``, each group's ending in ``""``."""
    found = [(*path, "")]
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        if isinstance(sub, click.Group):
            found += every_command(sub, (*path, name))
        elif sub is not None:
            found.append((*path, name))
    return found


ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|[ntr0abfve])")


def test_no_help_shows_a_literal_backslash_escape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``persist config`` (a group given no command) printed its help with every
    newline a literal ``\\x0a``: click shows that help as a usage error, which is escaped."""
    monkeypatch.setenv("PERSIST_HOME", str(tmp_path))  # nothing here runs, but be sure
    shown = {}
    for *path, last in every_command(cli):
        runs = [[*path, "--help"]] if last == "" else [[*path, last, "--help"]]
        if last == "":  # a group with no command shows its help
            runs.append(path)
        for args in runs:
            shown[" ".join(args)] = CliRunner().invoke(cli, args, prog_name="persist").output
    bad = {args: ESCAPE.findall(out) for args, out in shown.items() if ESCAPE.search(out)}
    assert not bad
    assert "Usage: persist config [OPTIONS] COMMAND" in shown["config"]  # help, not an error
