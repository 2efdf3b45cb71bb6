"""``persist rm``: delete sessions here, or (``--fleet``) from the tiers too, name by name.

A fleet delete cannot be all-or-nothing: Redis and S3 share no transaction, and a
tombstone written on one tier is not taken back.  So each name is deleted on its
own (a name whose tier could not be asked is deleted nowhere: ``Store.delete``),
a name that fails does not stop the others, and the command says what happened
to each and exits 1 naming the ones not deleted.

A session name is any text, ``[``, ``*`` and ``?`` included, so a name is always
that session (``persist rm 'notes[1]'`` never deletes ``notes1``): a pattern is
taken only behind ``--glob``, expands over this store's sessions only (never into
names only a tier holds), and the command lists what each pattern matched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..errors import (
    InvalidArgumentError,
    PersistError,
    ReadOnlyStoreError,
    SessionDeletedError,
    SessionNotFoundError,
)
from ..storage.types import EntryInfo
from .app import cli, complete_sessions, emit, json_option, open_store, plain, plural, store_option
from .interrupts import committed


@cli.command("rm")
@click.argument("names", nargs=-1, shell_complete=complete_sessions)
@click.option(
    "--glob",
    "patterns",
    multiple=True,
    metavar="PATTERN",
    help="Also the sessions of this store whose names match PATTERN (fnmatch: * ? [..]); "
    "NAMES are always taken as they are.",
)
@click.option("--all", "every", is_flag=True, help="Every session of the namespace.")
@click.option(
    "--fleet",
    is_flag=True,
    help="Delete the shared and cold tiers' session of each name too (a session this "
    "store no longer holds included), so the next one saved under the name replaces it.",
)
@click.option("--namespace", default="default", show_default=True)
@store_option
@json_option
def rm_cmd(
    names: tuple[str, ...],
    patterns: tuple[str, ...],
    every: bool,
    fleet: bool,
    namespace: str,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Delete sessions and their checkpoints: NAMES, --glob patterns, or --all.

    A name is taken as it is ('notes[1]' is that session, never 'notes1'); a
    pattern only behind --glob ('work-*'), matched against this store's sessions.
    Every name and pattern must match before anything is deleted.  A delete is
    local: the tiers keep their session of the name, and a new one saved here under
    it is pushed beside theirs (NAME~2), a conflict; --fleet deletes theirs too.
    Each name is deleted on its own: one that fails (a tier that cannot be asked,
    a name no tier holds) is reported and the others go on; exit 1 names those
    not deleted.  With --fleet a name already deleted fleet-wide (a tombstone on
    a tier, nothing here) is reported as such, not a failure: run it again after
    a partial failure.

    \b
    Example:
      persist rm work
      persist rm --glob 'draft-*' old
      persist rm --all --namespace trials
      persist rm --fleet chat
    """
    if not names and not patterns and not every:
        raise click.UsageError("give session names, --glob patterns, or --all")
    with open_store(store_dir) as store:
        if fleet and not store.tiers:
            raise InvalidArgumentError("rm --fleet needs --shared or --cold (or $PERSIST_*)")
        if store.read_only:  # the store's, not a name's: said once
            raise ReadOnlyStoreError(store.root)
        known = _known(store.entries(namespace))
        matched = _globbed(known, patterns, namespace)
        doomed = _matching(known, names, every, namespace, fleet)
        doomed += [n for hits in matched.values() for n in hits if n not in doomed]
        deleted, on_tiers, failed, already = _each(store, doomed, namespace, fleet)
    out = {
        "deleted": deleted,
        "fleet": on_tiers,
        "already_deleted": already,
        "namespace": namespace,
        "not_deleted": failed,
        "matched": matched,
    }
    emit(as_json, out, lambda _: _render_rm(deleted, on_tiers, failed, matched, already))
    if failed:
        if not as_json:
            left = plain(", ".join(f["session"] for f in failed))
            click.echo(
                f"persist: error: {len(failed)} of {plural(len(doomed), 'session')} "
                f"not deleted: {left}",
                err=True,
            )
        sys.exit(1)


def _each(
    store: Any, doomed: list[str], namespace: str, fleet: bool
) -> tuple[list[str], list[str], list[dict[str, str]], list[str]]:
    """Delete each name: (those deleted, those deleted from a tier too, those not:
    ``{"session", "error"}``, those a fleet delete had deleted already: a re-run)."""
    deleted: list[str] = []
    on_tiers: list[str] = []
    failed: list[dict[str, str]] = []
    already: list[str] = []
    for name in doomed:
        try:
            held = store.delete(name, namespace=namespace, fleet=fleet)
        except SessionDeletedError:  # a tombstone and nothing else: done before, not a failure
            already.append(name)
            continue
        except PersistError as e:
            failed.append({"session": name, "error": str(e)})
            continue
        deleted.append(name)
        if held:
            on_tiers.append(name)
        committed(_so_far(deleted, on_tiers))  # a Ctrl-C from here says what went
    return deleted, on_tiers, failed, already


def _so_far(deleted: list[str], on_tiers: list[str], most: int = 20) -> str:
    """What a Ctrl-C between two deletes reports (attack 38c, finding 6: it said only
    "interrupted", and the re-run the docs advise then listed those as missing)."""
    shown = ", ".join(plain(repr(n)) for n in deleted[:most])
    more = f" and {len(deleted) - most} more" if len(deleted) > most else ""
    tiers = f", {len(on_tiers)} from the tiers too" if on_tiers else ""
    return f"{plural(len(deleted), 'session')} deleted ({shown}{more}{tiers})"


def _render_rm(
    deleted: list[str],
    on_tiers: list[str],
    failed: list[dict[str, str]],
    matched: dict[str, list[str]],
    already: list[str],
) -> None:
    for pattern, hits in matched.items():  # what each pattern stood for, before it went
        click.echo(f"--glob {plain(repr(pattern))} matched: {plain(', '.join(hits))}")
    for f in failed:  # each name not deleted, with why (stdout lists what was)
        click.echo(f"persist: session {plain(repr(f['session']))} not deleted: "
                   f"{plain(f['error'])}", err=True)  # fmt: skip
    if already:
        click.echo(f"already deleted on the fleet: {plain(', '.join(already))}")
    if not deleted:
        return
    n, listed = len(deleted), plain(", ".join(deleted))
    said = f"session {plain(repr(deleted[0]))}" if n == 1 else f"{plural(n, 'session')}: {listed}"
    also = f" (from the tiers too: {plain(', '.join(on_tiers))})" if on_tiers else ""
    click.echo(f"deleted {said}{also}")


def _known(entries: list[EntryInfo]) -> list[str]:
    """This store's session names: a session, or the owner of checkpoints an
    interrupted prime left without one."""
    owners = (e.session or e.owner for e in entries)
    return list(dict.fromkeys(n for n in owners if n))


def _globbed(known: list[str], patterns: tuple[str, ...], namespace: str) -> dict[str, list[str]]:
    """Each ``--glob`` pattern's matches among this store's sessions (never a tier's
    names: a pattern is not sent to the fleet); SessionNotFoundError for one with none."""
    import fnmatch

    out: dict[str, list[str]] = {}
    for pattern in patterns:
        hits = [n for n in known if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise SessionNotFoundError(pattern, namespace, "no session matches --glob")
        out[pattern] = hits
    return out


def _matching(
    known: list[str],
    names: tuple[str, ...],
    every: bool,
    namespace: str,
    exact_ok: bool = False,
) -> list[str]:
    """The session names to delete, each once, in the order given; SessionNotFoundError
    for a name this store lacks (nothing is deleted then).  A name is the name, glob
    characters and all.  ``exact_ok`` (--fleet): a name is taken as given (the tiers
    may hold it)."""
    if every:
        return known
    out: list[str] = []
    for name in names:
        if name not in known and not exact_ok:
            hint = "to match a pattern, use --glob" if any(c in name for c in "*?[") else ""
            raise SessionNotFoundError(name, namespace, hint)
        if name not in out:
            out.append(name)
    return out
