"""Store commands: ls, show, check, pin, unpin (rm: ``removal``)."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from ..errors import SessionNotFoundError
from ..storage.types import EntryInfo
from .app import (
    cli,
    complete_sessions,
    emit,
    human_bytes,
    json_option,
    open_index,
    open_store,
    plain,
    plural,
    progress,
    store_option,
)

_namespace = click.option("--namespace", default="default", show_default=True)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _row(e: EntryInfo) -> str:
    name = (
        e.session
        if e.session is not None
        else f"({e.role} of {e.owner})"
        if e.owner
        else f"({e.role})"
    )
    pin = " pinned" if e.pinned else ""
    model = "DAMAGED (persist check --fix)" if e.damaged else plain(e.model)
    ns, shown = plain(e.namespace), plain(name)
    head = f"{ns:<10} {shown:<28}"
    rest = (
        f" {e.tokens:>7} tok {human_bytes(e.bytes):>10}  used {_when(e.used)}"
        f"{pin:<7}  {model}"  # the model last: a repo id of any length keeps the columns
    )
    if len(ns) > 10 or len(shown) > 28:  # a long name on its own line, whole
        return f"{ns} {shown}\n{'':<39}{rest}"
    return head + rest


@cli.command("ls")
@click.option("--namespace", default=None, help="Only this namespace (default: all).")
@click.option("--all", "show_all", is_flag=True, help="Also list checkpoints and prefixes.")
@click.option(
    "--sort",
    type=click.Choice(["name", "used", "size"]),
    default="name",
    show_default=True,
    help="By namespace and name, latest used first, or largest first.",
)
@click.option("--prefix", default=None, help="Only sessions whose name starts with this.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="At most this many rows.")
@store_option
@json_option
def ls_cmd(
    namespace: str | None,
    show_all: bool,
    sort: str,
    prefix: str | None,
    limit: int | None,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """List stored sessions, streamed: the first rows come at once, whatever the store's size.

    \b
    Example:
      persist ls --sort used --limit 20
      persist ls --prefix user- --all --json
    """
    from ..storage.listing import stream, unnamed_counts

    with open_index(store_dir) as index:
        if limit is not None:
            limit = min(limit, sys.maxsize)  # more rows than that is every row
        rows = stream(index, namespace, every=show_all, sort=sort, prefix=prefix, limit=limit)
        entries = (index.checked_info(r) for r in rows)  # a damaged row: marked
        if as_json:
            _json_array(entries)
            return
        shown = 0
        for e in entries:
            click.echo(_row(e))
            shown += 1
        if not shown:
            click.echo("no sessions")
        hidden = "" if show_all or prefix else _hidden(unnamed_counts(index, namespace))
        if hidden:
            click.echo(hidden)


def _json_array(entries: Iterator[EntryInfo]) -> None:
    """One JSON array (as ``emit`` writes it), each item written as it comes."""
    import json  # here, not at the top: plain `persist ls` starts without them
    import textwrap

    first = True
    for e in entries:
        item = json.dumps(e.to_dict(), indent=2, sort_keys=True, default=str)
        click.echo(("[\n" if first else ",\n") + textwrap.indent(item, "  "), nl=False)
        first = False
    click.echo("[]" if first else "\n]")


def _hidden(roles: dict[str, int]) -> str:
    """The line that says what plain ``ls`` does not list, and how to see it."""
    names = (("checkpoint", "checkpoint", "checkpoints"), ("prefix", "prefix", "prefixes"))
    parts = [
        f"{n} {one if n == 1 else many}" for role, one, many in names if (n := roles.get(role, 0))
    ]
    if not parts:
        return ""
    why = " (prompts persist serve cached)" if roles.get("prefix") else ""
    return f"also {' and '.join(parts)}{why}: persist ls --all lists them"


@cli.command("show")
@click.argument("name", shell_complete=complete_sessions)
@_namespace
@store_option
@json_option
def show_cmd(name: str, namespace: str, store_dir: Path | None, as_json: bool) -> None:
    """Show one session: kinds per layer, tokens, bytes, resume facts, identity.

    \b
    Example:
      persist show work
    """
    with open_index(store_dir) as index:
        row = index.by_name(namespace, name)
        if row is None:
            raise SessionNotFoundError(name, namespace)
        e = index.checked_info(row)  # a row that does not decode or check is shown damaged

    def render(_: Any) -> None:
        click.echo(f"session {e.session!r} in namespace {e.namespace!r}")
        if e.damaged:
            click.echo(f"  DAMAGED            {e.damaged}: persist check --fix repairs it")
        click.echo(f"  tokens             {e.tokens}")
        click.echo(f"  bytes              {human_bytes(e.bytes)} (shared blocks included)")
        click.echo(f"  trimmable          {e.trimmable}")
        click.echo(f"  min resume offset  {e.min_resume_offset}")
        click.echo(f"  model              {plain(e.model)} ({plain(e.identity[:16])})")
        click.echo(f"  created / used     {_when(e.created)} / {_when(e.used)}")
        click.echo(f"  pinned             {e.pinned}")
        for i, k in enumerate(e.kinds):
            click.echo(f"  layer {i:3d}          {k}")
        if chat:
            click.echo(f"  chat               {plural(len(chat), 'message')}")
            for m in chat:
                click.echo(f"    {m.get('role', '?'):<9} {_one_line(m.get('content', ''))}")

    chat = _chat(e)
    emit(as_json, {**e.to_dict(), **({"chat": chat} if chat else {})}, render)


def _chat(e: EntryInfo) -> list[dict[str, str]]:
    """A chat session's messages (``--chat`` keeps them in its metadata); [] otherwise."""
    import json

    raw = e.metadata.get("persist.chat")
    try:
        got = json.loads(raw) if raw else []
    except ValueError:
        return []
    return [m for m in got if isinstance(m, dict)] if isinstance(got, list) else []


def _one_line(text: object, width: int = 100) -> str:
    """A message on one line: newlines and control characters shown as escapes."""
    flat = str(text).encode("unicode_escape").decode("ascii", "replace")
    return flat if len(flat) <= width else flat[: width - 3] + "..."


@cli.command("check")
@click.option(
    "--fix",
    is_flag=True,
    help="Repair: keep the valid part of damaged sessions, quarantine damaged blobs, "
    "delete orphans.",
)
@store_option
@json_option
def check_cmd(fix: bool, store_dir: Path | None, as_json: bool) -> None:
    """Verify every blob and reconcile the index with the files.

    With --fix a damaged session keeps what is still valid (its blocks before the
    damage, or its deepest valid checkpoint) and each changed session is named with
    what it lost; damaged files go to quarantine/, which gc clears after 14 days.
    Exits 1 if problems remain (none remain after a successful --fix).

    \b
    Example:
      persist check --fix
    """
    with open_store(store_dir) as store:
        problems = store.check(fix=fix, progress=progress("checking"))

    def render(_: Any) -> None:
        for p in problems:
            what = "fixed" if p.fixed else "problem"
            click.echo(f"{what}: {p.kind}: {plain(p.target)}: {plain(p.detail)}")
        left = sum(not p.fixed for p in problems)
        if not problems:
            click.echo("store is consistent")
        elif fix:
            click.echo(f"fixed {len(problems) - left} of {plural(len(problems), 'problem')}")
        else:
            click.echo(plural(len(problems), "problem"))

    emit(as_json, [p.to_dict() for p in problems], render)
    if any(not p.fixed for p in problems):
        raise SystemExit(1)


@cli.command("pin")
@click.argument("name", shell_complete=complete_sessions)
@click.option(
    "--ttl",
    default=None,
    help="Instead of pinning for good: evict it after every entry without a hint, "
    "for this long after its last use (30s, 5m, 1h, 2d; 0 clears).",
)
@click.option(
    "--priority",
    type=click.IntRange(-1000, 1000),
    default=None,
    help="Instead of pinning for good: higher is evicted later (default 0).",
)
@_namespace
@store_option
@json_option
def pin_cmd(
    name: str,
    ttl: str | None,
    priority: int | None,
    namespace: str,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Keep a session (and its checkpoints) out of budget eviction; with --ttl or
    --priority, keep it ahead of others within the budget instead (never past it).

    \b
    Example:
      persist pin work
      persist pin agent-system-prompt --ttl 1h --priority 5
    """
    if ttl is None and priority is None:
        _pin(name, namespace, store_dir, as_json, True)
        return
    from ..engine.lifecycle import parse_ttl

    seconds = None if ttl is None else parse_ttl(ttl)
    with open_store(store_dir) as store:
        store.retain(name, ttl=seconds, priority=priority, namespace=namespace)
    out = {"session": name, "namespace": namespace, "ttl": seconds, "priority": priority}
    emit(as_json, out, lambda _: click.echo(f"retention hints of session {name!r}: {_hints(out)}"))


def _hints(out: dict[str, Any]) -> str:
    said = [f"ttl {out['ttl']:g} s" if out["ttl"] else "", f"priority {out['priority']}"
            if out["priority"] else ""]  # fmt: skip
    return ", ".join(x for x in said if x) or "cleared"


@cli.command("unpin")
@click.argument("name", shell_complete=complete_sessions)
@_namespace
@store_option
@json_option
def unpin_cmd(name: str, namespace: str, store_dir: Path | None, as_json: bool) -> None:
    """Let a pinned session be evicted again when the store is over its budget.

    \b
    Example:
      persist unpin work
    """
    _pin(name, namespace, store_dir, as_json, False)


def _pin(name: str, namespace: str, store_dir: Path | None, as_json: bool, pinned: bool) -> None:
    with open_store(store_dir) as store:
        store.pin(name, namespace=namespace, pinned=pinned)
    emit(
        as_json,
        {"session": name, "namespace": namespace, "pinned": pinned},
        lambda _: click.echo(f"{'pinned' if pinned else 'unpinned'} session {name!r}"),
    )


def _exists(store: Any, name: str, namespace: str) -> bool:
    try:
        store.entry(name, namespace=namespace)
    except SessionNotFoundError:
        return False
    return True
