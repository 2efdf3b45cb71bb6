"""Sessions in and out of the store: export, import (persist and mlx-lm files), sync (tiers)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..errors import AlreadyExistsError, InvalidArgumentError
from .app import cli, emit, json_option, open_store, plain, store_option
from .sessions import _exists, _namespace

_force = click.option("--force", is_flag=True, help="Replace what is already there.")


@cli.command("export")
@click.argument("name")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["persist", "mlx-lm"]),
    default="persist",
    show_default=True,
    help="mlx-lm: a file mlx_lm's load_prompt_cache reads (no tokens, no identity).",
)
@_namespace
@_force
@store_option
@json_option
def export_cmd(
    name: str,
    file: Path,
    fmt: str,
    namespace: str,
    force: bool,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Write a session to one file (an existing file needs --force).

    \b
    Example:
      persist export work work.safetensors
      persist export work work-mlx.safetensors --format mlx-lm
    """
    if file.exists() and not force:
        raise AlreadyExistsError(f"{file} exists; pass --force to replace it")
    with open_store(store_dir) as store:
        e = store.export(name, file, namespace=namespace, format=fmt)
    emit(
        as_json,
        {"session": name, "file": str(file), "tokens": e.tokens},
        lambda _: click.echo(f"exported {name!r} ({e.tokens} tokens) to {plain(file)}"),
    )


@cli.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--session", default=None, help="Session name (default: the file's name).")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="For an mlx-lm prompt cache: the model that computed it.",
)
@click.option("--tokens", default=None, help="For an mlx-lm file: the token ids it covers, 1,2,3.")
@click.option("--prompt", default=None, help="For an mlx-lm file: the text it covers.")
@_namespace
@_force
@store_option
@json_option
def import_cmd(
    file: Path,
    session: str | None,
    model_dir: Path | None,
    tokens: str | None,
    prompt: str | None,
    namespace: str,
    force: bool,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Store a file as a session (an existing one needs --force).

    A persist file (from export or save_file) carries its tokens and model.
    An mlx-lm prompt cache (save_prompt_cache, mlx_lm.cache_prompt) carries
    neither: give --model and the --prompt (or --tokens) it was computed from.

    \b
    Example:
      persist import work.safetensors --session work-copy
      persist import prompt.safetensors --model ./my-model --prompt "You are..."
    """
    name = session if session is not None else file.name.split(".")[0]
    identity, ids = _foreign_inputs(model_dir, tokens, prompt)
    with open_store(store_dir) as store:
        if not force and _exists(store, name, namespace):
            raise AlreadyExistsError(f"session {name!r} exists; pass --force to replace it")
        e = store.import_file(
            file, session=name, namespace=namespace, identity=identity, tokens=ids
        )
    emit(
        as_json,
        e.to_dict(),
        lambda _: click.echo(
            f"imported {plain(file)} as session {e.session!r} ({e.tokens} tokens)"
        ),
    )


def _foreign_inputs(
    model_dir: Path | None, tokens: str | None, prompt: str | None
) -> tuple[Any, list[int] | None]:
    """(identity, token ids) from --model and --tokens/--prompt, for an mlx-lm file."""
    if tokens is not None and prompt is not None:
        raise click.UsageError("give at most one of --tokens and --prompt")
    if model_dir is None:
        if prompt is not None:
            raise click.UsageError("--prompt needs --model (its tokenizer)")
        return None, _ids(tokens)
    from ..apps.generate import load_model

    _, tok, identity = load_model(model_dir)
    ids = _ids(tokens) if prompt is None else list(tok.encode(prompt, add_special_tokens=False))
    return identity, ids


def _ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.UsageError("--tokens takes integers separated by commas") from None


@cli.command("sync")
@click.option("--pull", "names", multiple=True, help="A named session to fetch (repeatable).")
@click.option("--namespace", default=None, help="Only this namespace (default: all).")
@store_option
@json_option
def sync_cmd(
    names: tuple[str, ...], namespace: str | None, store_dir: Path | None, as_json: bool
) -> None:
    """Push what the tiers (--shared, --cold) lack; fetch named sessions this store lacks.

    Reports, per tier, snapshots pushed, already there and failed; exits 1 when any
    push failed (a tier down, refused, or holding another namespace secret).

    \b
    Example:
      persist sync --shared redis://127.0.0.1:6379/0 --pull work
    """
    with open_store(store_dir) as store:
        if not store.tiers:
            raise InvalidArgumentError("persist sync needs --shared or --cold (or $PERSIST_*)")
        r = store.sync(namespace=namespace, pull=list(names))

    def render(_: Any) -> None:
        for tier, n in r["tiers"].items():
            click.echo(
                f"{tier}: pushed {n['pushed']}, already there {n['present']}, "
                f"failed {n['failed']} (of {r['snapshots']} snapshots)"
            )
        click.echo(f"pulled {len(r['pulled'])} sessions")
        if r["missing"]:
            click.echo(f"not in any tier: {plain(', '.join(r['missing']))}")

    emit(as_json, r, render)
    if r["failed"]:  # a push that did not happen is not a success
        click.echo(f"persist: {r['snapshots_failed']} snapshots did not reach a tier", err=True)
        sys.exit(1)
