"""Store upkeep: ``persist gc``, ``persist stats``, ``persist config`` (the remembered budget)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .app import (
    cli,
    emit,
    human_bytes,
    json_option,
    open_store,
    parse_size,
    plain,
    plural,
    store_option,
)
from .sessions import _row

BUDGET_HELP = "the default: a tenth of the disk, at most 20 GiB"


def _budget_text(b: int | None, source: str) -> str:
    if b is None:
        return "no budget (persist config set max-bytes none)"
    why = BUDGET_HELP if source == "default" else "persist config set max-bytes"
    return f"budget {human_bytes(b)} ({why})"


@cli.command("gc")
@click.option(
    "--max-bytes",
    default=None,
    help="Budget to evict down to, e.g. 500M or 2G (default: the store's budget).",
)
@click.option("--dry-run", is_flag=True, help="Only report what would be evicted.")
@store_option
@json_option
def gc_cmd(max_bytes: str | None, dry_run: bool, store_dir: Path | None, as_json: bool) -> None:
    """Evict least recently used unpinned entries down to the budget; delete
    unreferenced blobs; compact the index when most of the store went.

    \b
    Example:
      persist gc --max-bytes 2G --dry-run
    """
    from ..storage import housekeeping

    with open_store(store_dir) as store:
        budget: int | None
        if max_bytes is not None:
            budget, source = parse_size(max_bytes), "option"
        else:
            budget, source = housekeeping.budget(store.index, store.root)
        r = store.gc(budget, dry_run=dry_run)
        # most of it went: compact, where the disk has room for it
        compacted = not dry_run and r.bytes_freed > r.unique_bytes
        compacted = compacted and housekeeping.vacuum(store.index, store.root)
        pinned = [e for e in store.entries() if e.pinned]
        files = housekeeping.files_bytes(store.root)
    over = budget is not None and r.unique_bytes > budget
    data = {
        **r.to_dict(),
        "budget": budget,
        "budget_source": source,
        "over_budget": over,
        "compacted": compacted,
        "files": files,
    }

    def render(_: Any) -> None:
        verb = "would evict" if r.dry_run else "evicted"
        now, after = r.unique_bytes + r.bytes_freed, r.unique_bytes
        sizes = (
            f"blobs now {human_bytes(now)}, after {human_bytes(after)}"
            if r.dry_run
            else f"{human_bytes(files['total'])} on disk in all"
            + (" (index compacted)" if compacted else "")
        )
        click.echo(
            f"{verb} {plural(len(r.evicted), 'entry', 'entries')}, freeing "
            f"{human_bytes(r.bytes_freed)} of blob files; {sizes}"
        )
        for e in r.evicted:
            click.echo("  " + _row(e))
        if over and budget is not None:
            held = sum(e.bytes for e in pinned)
            click.echo(
                f"still {human_bytes(r.unique_bytes - budget)} over the budget of "
                f"{human_bytes(budget)}: {plural(len(pinned), 'pinned session')} "
                f"{'holds' if len(pinned) == 1 else 'hold'} {human_bytes(held)} "
                "(persist unpin NAME lets gc evict one)"
            )
        if r.unpushed_kept:  # their only copy: a tier could not take them yet
            click.echo(
                f"kept {plural(r.unpushed_kept, 'named session')} not yet on a tier "
                "(a push held back or failed): persist sync pushes them, then gc may evict"
            )

    emit(as_json, data, render)


@cli.command("stats")
@click.option("--namespace", default=None, help="Counters of this namespace only.")
@store_option
@json_option
def stats_cmd(namespace: str | None, store_dir: Path | None, as_json: bool) -> None:
    """Entries, bytes on disk (every file), the budget, dedup ratio, hits and misses.

    \b
    Example:
      persist stats --json
    """
    from ..storage import housekeeping

    with open_store(store_dir) as store:
        s = store.stats(namespace)
        budget, source = housekeeping.budget(store.index, store.root)
        files = housekeeping.files_bytes(store.root)
    data = {**s.to_dict(), "files": files, "budget": budget, "budget_source": source}

    def render(_: Any) -> None:
        click.echo(
            f"{plural(s.entries, 'entry', 'entries')} ({plural(s.sessions, 'session')}); "
            f"{_budget_text(budget, source)}"
        )
        click.echo(
            f"on disk {human_bytes(files['total'])}: index {human_bytes(files['index'])} "
            f"(write-ahead log {human_bytes(files['wal'])}), "
            f"blobs {human_bytes(files['blobs'])}, other {human_bytes(files['other'])}"
        )
        click.echo(
            f"blobs live {human_bytes(s.unique_bytes)}, referenced "
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

    emit(as_json, data, render)


def _render_rate(r: dict[str, Any]) -> str:
    """One measured rate (the median of its latest runs): restores in bytes/s per tier,
    prefills in tokens/s per model; a process's first run (one-time costs) apart."""
    lo = 1 << max(0, r["bucket"] - 1)
    what, first = str(r["what"]).removesuffix("-first"), str(r["what"]).endswith("-first")
    runs = f"{plural(r['samples'], 'run')}, latest {len(r.get('recent') or [])}"
    if what == "restore":
        head = (
            f"first restore from {r['key']} in a process" if first else f"restore from {r['key']}"
        )
        speed = human_bytes(int(r["rate"]))
        return f"rate {r['machine']} {head} ({human_bytes(lo)}+): {speed}/s ({runs})"
    head = "first prefill in a process" if first else "prefill"
    return (
        f"rate {r['machine']} {head} at {lo}+ tokens of {r['key'][:12]}: "
        f"{r['rate']:.0f} tokens/s ({runs})"
    )


def _render_decision(d: dict[str, Any]) -> str:
    def secs(v: float | None) -> str:
        return "unmeasured" if v is None else f"{v:.3f} s"

    chosen = "restore" if d["restore"] else "recompute"
    if d["reason"] == "max_cost":  # judged against the caller's limit, not the prefill
        side = "within" if d["restore"] else "over"
        return (
            f"decision {chosen}: {d['tokens']} tokens from {d['tier']}, restore "
            f"{secs(d['restore_s'])} {side} the caller's max_cost"
        )
    why = d["reason"]
    if d.get("samples") is not None:
        why += f", {plural(d['samples'], 'sample')}"
    if d["reason"] == "bound" and d.get("floor_s") is not None:
        why += f": {d['floor_s']:.3f} s at the fastest rate measured here"
    return (
        f"decision {chosen}: {d['tokens']} tokens from {d['tier']}, restore "
        f"{secs(d['restore_s'])} vs prefill {secs(d['prefill_s'])} ({why})"
    )


@cli.group("config")
def config_group() -> None:
    """A store's remembered settings (max-bytes: its budget).

    \b
    Example:
      persist config set max-bytes 5G
      persist config get max-bytes
    """


@config_group.command("reset-rates")
@click.option("--machine", default=None, help="Only this machine's (as persist stats names it).")
@store_option
@json_option
def config_reset_rates(machine: str | None, store_dir: Path | None, as_json: bool) -> None:
    """Forget the measured restore and prefill rates: the cost model learns again.

    \b
    Example:
      persist config reset-rates
    """
    from ..storage import rates

    with open_store(store_dir) as store:
        n = rates.reset(store.index, machine)
    emit(as_json, {"reset": n}, lambda _: click.echo(f"forgot {plural(n, 'rate')}"))


@config_group.command("set")
@click.argument("key", type=click.Choice(["max-bytes"]))
@click.argument("value")
@store_option
@json_option
def config_set(key: str, value: str, store_dir: Path | None, as_json: bool) -> None:
    """Remember KEY for this store (max-bytes: a size like 5G, or none).

    \b
    Example:
      persist config set max-bytes 5G
    """
    from ..storage import housekeeping

    stored = value.lower() if value.lower() == housekeeping.NO_BUDGET else str(parse_size(value))
    with open_store(store_dir) as store:
        housekeeping.set_setting(store.index, key, stored)
        budget, source = housekeeping.budget(store.index, store.root)
    emit(
        as_json,
        {"key": key, "value": budget},
        lambda _: click.echo(f"{key}: {_budget_text(budget, source)}"),
    )


@config_group.command("get")
@click.argument("key", type=click.Choice(["max-bytes"]))
@store_option
@json_option
def config_get(key: str, store_dir: Path | None, as_json: bool) -> None:
    """Show KEY: the remembered value, or the default.

    \b
    Example:
      persist config get max-bytes
    """
    from ..storage import housekeeping

    with open_store(store_dir) as store:
        budget, source = housekeeping.budget(store.index, store.root)
    emit(
        as_json,
        {"key": key, "value": budget, "source": source},
        lambda _: click.echo(f"{key}: {_budget_text(budget, source)}"),
    )


@config_group.command("unset")
@click.argument("key", type=click.Choice(["max-bytes"]))
@store_option
@json_option
def config_unset(key: str, store_dir: Path | None, as_json: bool) -> None:
    """Forget KEY: back to the default.

    \b
    Example:
      persist config unset max-bytes
    """
    from ..storage import housekeeping

    with open_store(store_dir) as store:
        housekeeping.set_setting(store.index, key, None)
        budget, source = housekeeping.budget(store.index, store.root)
    emit(
        as_json,
        {"key": key, "value": budget, "source": source},
        lambda _: click.echo(f"{key}: {_budget_text(budget, source)}"),
    )
