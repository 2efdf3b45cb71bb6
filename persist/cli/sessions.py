"""Store commands: ls, show, rm, gc, check, stats, export, import, pin, sync."""

from __future__ import annotations

import datetime
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from ..errors import SessionNotFoundError
from ..store.types import EntryInfo
from .app import (
    cli,
    emit,
    human_bytes,
    json_option,
    open_store,
    parse_size,
    plain,
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
    return (
        f"{plain(e.namespace):<10} {plain(name):<28} {e.tokens:>7} tok "
        f"{human_bytes(e.bytes):>10}  {model:<16} used {_when(e.used)}{pin}"
    )


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
    from ..store.listing import stream, unnamed_counts

    with open_store(store_dir) as store:
        rows = stream(store.index, namespace, every=show_all, sort=sort, prefix=prefix, limit=limit)
        entries = (store.index.checked_info(r) for r in rows)  # a damaged row: marked
        if as_json:
            _json_array(entries)
            return
        shown = 0
        for e in entries:
            click.echo(_row(e))
            shown += 1
        if not shown:
            click.echo("no sessions")
        hidden = "" if show_all or prefix else _hidden(unnamed_counts(store.index, namespace))
        if hidden:
            click.echo(hidden)


def _json_array(entries: Iterator[EntryInfo]) -> None:
    """One JSON array (as ``emit`` writes it), each item written as it comes."""
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
@click.argument("name")
@_namespace
@store_option
@json_option
def show_cmd(name: str, namespace: str, store_dir: Path | None, as_json: bool) -> None:
    """Show one session: kinds per layer, tokens, bytes, resume facts, identity.

    \b
    Example:
      persist show work
    """
    with open_store(store_dir) as store:
        e = store.entry(name, namespace=namespace)

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

    emit(as_json, e.to_dict(), render)


@cli.command("rm")
@click.argument("name")
@_namespace
@store_option
@json_option
def rm_cmd(name: str, namespace: str, store_dir: Path | None, as_json: bool) -> None:
    """Delete a session and its checkpoints.

    \b
    Example:
      persist rm work
    """
    with open_store(store_dir) as store:
        store.delete(name, namespace=namespace)
    emit(
        as_json,
        {"deleted": name, "namespace": namespace},
        lambda _: click.echo(f"deleted session {name!r}"),
    )


@cli.command("gc")
@click.option("--max-bytes", default=None, help="Budget to evict down to, e.g. 500M or 2G.")
@click.option("--dry-run", is_flag=True, help="Only report what would be evicted.")
@store_option
@json_option
def gc_cmd(max_bytes: str | None, dry_run: bool, store_dir: Path | None, as_json: bool) -> None:
    """Evict least recently used unpinned entries; delete unreferenced blobs.

    \b
    Example:
      persist gc --max-bytes 2G --dry-run
    """
    budget = parse_size(max_bytes) if max_bytes is not None else None
    with open_store(store_dir) as store:
        r = store.gc(budget, dry_run=dry_run)

    def render(_: Any) -> None:
        verb = "would evict" if r.dry_run else "evicted"
        now, after = r.unique_bytes + r.bytes_freed, r.unique_bytes
        sizes = (
            f"now {human_bytes(now)}, after {human_bytes(after)}"
            if r.dry_run
            else f"{human_bytes(after)} on disk"
        )
        click.echo(
            f"{verb} {len(r.evicted)} entries, freeing {human_bytes(r.bytes_freed)}; {sizes}"
        )
        for e in r.evicted:
            click.echo("  " + _row(e))

    emit(as_json, r.to_dict(), render)


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
            click.echo(f"fixed {len(problems) - left} of {_count(len(problems), 'problem')}")
        else:
            click.echo(_count(len(problems), "problem"))

    emit(as_json, [p.to_dict() for p in problems], render)
    if any(not p.fixed for p in problems):
        raise SystemExit(1)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


@cli.command("stats")
@click.option("--namespace", default=None, help="Counters of this namespace only.")
@store_option
@json_option
def stats_cmd(namespace: str | None, store_dir: Path | None, as_json: bool) -> None:
    """Entries, bytes on disk, dedup ratio, hits and misses.

    \b
    Example:
      persist stats --json
    """
    with open_store(store_dir) as store:
        s = store.stats(namespace)

    def render(_: Any) -> None:
        click.echo(f"entries {s.entries} ({s.sessions} sessions)")
        click.echo(
            f"on disk {human_bytes(s.unique_bytes)}, referenced "
            f"{human_bytes(s.referenced_bytes)}, dedup {s.dedup_ratio:.2f}x"
        )
        for k, v in sorted(s.counters.items()):
            click.echo(f"{plain(k)} {v}")
        for r in s.rates:
            click.echo(plain(_render_rate(r)))
        for d in s.decisions:
            click.echo(plain(_render_decision(d)))
        for machine, path in s.data_paths.items():
            click.echo(plain(f"data path {machine}: {path}"))

    emit(as_json, s.to_dict(), render)


def _render_rate(r: dict[str, Any]) -> str:
    """One measured rate: restores in bytes/s per tier, prefills in tokens/s per model."""
    lo = 1 << max(0, r["bucket"] - 1)
    if r["what"] == "restore":
        return (
            f"rate {r['machine']} restore from {r['key']} ({human_bytes(lo)}+): "
            f"{human_bytes(int(r['rate']))}/s ({r['samples']} runs)"
        )
    return (
        f"rate {r['machine']} prefill at {lo}+ tokens of {r['key'][:12]}: "
        f"{r['rate']:.0f} tokens/s ({r['samples']} runs)"
    )


def _render_decision(d: dict[str, Any]) -> str:
    def secs(v: float | None) -> str:
        return "unmeasured" if v is None else f"{v:.3f} s"

    chosen = "restore" if d["restore"] else "recompute"
    return (
        f"decision {chosen}: {d['tokens']} tokens from {d['tier']}, restore "
        f"{secs(d['restore_s'])} vs prefill {secs(d['prefill_s'])} ({d['reason']})"
    )


@cli.command("pin")
@click.argument("name")
@_namespace
@store_option
@json_option
def pin_cmd(name: str, namespace: str, store_dir: Path | None, as_json: bool) -> None:
    """Keep a session (and its checkpoints) out of budget eviction.

    \b
    Example:
      persist pin work
    """
    _pin(name, namespace, store_dir, as_json, True)


@cli.command("unpin")
@click.argument("name")
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
