"""Sessions in and out of the store: export, import (persist and mlx-lm files), sync (tiers)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..errors import AlreadyExistsError, InvalidArgumentError
from .app import cli, complete_sessions, emit, json_option, open_store, plain, store_option
from .interrupts import committed
from .prompts import utf8_argument
from .sessions import _exists, _namespace

_force = click.option("--force", is_flag=True, help="Replace what is already there.")


@cli.command("export")
@click.argument("name", shell_complete=complete_sessions)
@click.argument("file", type=click.Path(path_type=Path))  # a folder: ExportTargetError
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["persist", "mlx-lm"]),
    default="persist",
    show_default=True,
    help="mlx-lm: a file mlx_lm's load_prompt_cache reads (no tokens, no identity).",
)
@click.option(
    "--model",
    "model_dir",
    default=None,
    help="For --format mlx-lm: the model (folder, or repo id in the Hugging Face cache), "
    "as you will give it to mlx_lm generate: recorded in the file, and its files are "
    "checked against the session's model. Default: the folder the session's model "
    "was loaded from.",
)
@_namespace
@_force
@store_option
@json_option
def export_cmd(
    name: str,
    file: Path,
    fmt: str,
    model_dir: str | None,
    namespace: str,
    force: bool,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Write a session to one file (an existing file needs --force).

    \b
    Example:
      persist export work work.safetensors
      persist export work work-mlx.safetensors --format mlx-lm --model ./my-model
      python -m mlx_lm generate --model ./my-model --prompt-cache-file work-mlx.safetensors \\
          --prompt "and then?"
    """
    if model_dir is not None and fmt != "mlx-lm":
        raise click.UsageError("--model is for --format mlx-lm (a persist file names its model)")
    folder = None
    if model_dir is not None:  # the files the session is checked against: never downloaded
        from ..apps.hub import resolve_model

        folder = resolve_model(model_dir, download=False)
    with open_store(store_dir) as store:  # reads only: no store is made
        e = store.export(
            name, file, namespace=namespace, format=fmt, model=model_dir, model_dir=folder,
            replace=force,
        )  # fmt: skip
    emit(
        as_json,
        {"session": name, "file": str(file), "tokens": e.tokens},
        lambda _: click.echo(f"exported {name!r} ({e.tokens} tokens) to {plain(file)}"),
    )


@cli.command("import")
@click.argument("file", type=click.Path(path_type=Path))  # judged by the reader: typed, exit 1
@click.option("--session", default=None, help="Session name (default: the file's name).")
@click.option(
    "--model",
    "model_dir",
    default=None,
    metavar="PATH_OR_REPO",
    help="The model the file is for (folder or repo id): an mlx-lm prompt cache's, "
    "whose own name for its model must be this one; a persist file's model is checked "
    "against it.",
)
@click.option("--tokens", default=None, help="For an mlx-lm file: the token ids it covers, 1,2,3.")
@click.option(
    "--prompt", default=None, callback=utf8_argument,
    help="For an mlx-lm file: the text it covers.",
)  # fmt: skip
@click.option(
    "--chat",
    is_flag=True,
    help="The --prompt was one user message under the chat template, as "
    "mlx_lm.cache_prompt applies it.",
)
@click.option(
    "--unverified-tokens",
    is_flag=True,
    help="A purely recurrent cache records no position count, so its tokens cannot be "
    "checked: store it anyway, restorable by its name only, never serving another prompt.",
)
@click.option(
    "--trust-model",
    is_flag=True,
    help="For an mlx-lm file: take --model's word for the model it was computed with, "
    "though the file names one not on this machine or another.",
)
@_namespace
@_force
@store_option
@json_option
def import_cmd(
    file: Path,
    session: str | None,
    model_dir: str | None,
    tokens: str | None,
    prompt: str | None,
    chat: bool,
    unverified_tokens: bool,
    trust_model: bool,
    namespace: str,
    force: bool,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Store a file as a session (an existing one needs --force).

    A persist file (from export or save_file) carries its tokens and model
    (with --model, refused unless it names that model). Under the operator key
    ($PERSIST_TIER_KEY, --tier-key-file) it must carry that key's tag, which an
    export under the key writes. Without a key it is trusted as written: its
    tokens are believed, so import only files you trust. An mlx-lm prompt cache
    (save_prompt_cache, mlx_lm.cache_prompt) carries neither: give --model and
    the --prompt (or --tokens) it was computed from. The model such a file names
    (cache_prompt and export write it) must be --model's, unless --trust-model.

    \b
    Example:
      persist import work.safetensors --session work-copy
      persist import prompt.safetensors --model ./my-model --prompt "You are..."
    """
    from ..engine.transfer import check_readable

    check_readable(file)  # a folder, a FIFO, a missing file: refused before a store is made
    name = session if session is not None else file.name.split(".")[0]
    model, identity, ids, templated = _foreign_inputs(model_dir, tokens, prompt, chat)
    with open_store(store_dir, create=True) as store:
        if not force and _exists(store, name, namespace):
            raise AlreadyExistsError(f"session {name!r} exists; pass --force to replace it")
        e = store.import_file(
            file,
            session=name,
            namespace=namespace,
            identity=identity,
            tokens=ids,
            model=model,
            unverified_tokens=unverified_tokens,
            chat_tokens=templated,
            trust_model=trust_model,
        )
        committed(f"session {e.session!r} was imported ({e.tokens} tokens)")
    emit(
        as_json,
        e.to_dict(),
        lambda _: click.echo(
            f"imported {plain(file)} as session {e.session!r} ({e.tokens} tokens)"
        ),
    )


def _foreign_inputs(
    model_dir: str | None, tokens: str | None, prompt: str | None, chat: bool
) -> tuple[Any, Any, list[int] | None, list[int] | None]:
    """(model, identity, token ids, the text's ids under the chat template) from
    --model (a folder or Hugging Face repo id) and --tokens/--prompt (--chat), for
    an mlx-lm file."""
    if tokens is not None and prompt is not None:
        raise click.UsageError("give at most one of --tokens and --prompt")
    if chat and prompt is None:
        raise click.UsageError("--chat applies the chat template to --prompt")
    if model_dir is None:
        if prompt is not None:
            raise click.UsageError("--prompt needs --model (its tokenizer)")
        return None, None, _ids(tokens), None
    from ..apps.generate import load_model

    model, tok, identity = load_model(model_dir)
    if prompt is None:
        return model, identity, _ids(tokens), None
    templated = cache_prompt_tokens(tok, prompt)
    raw = list(tok.encode(prompt, add_special_tokens=False))
    return model, identity, templated if chat else raw, None if chat else templated


def cache_prompt_tokens(tok: Any, prompt: str) -> list[int]:
    """The tokens ``mlx_lm.cache_prompt`` caches for ``prompt``: one user message under
    the chat template (continuing it, no generation prompt), else the plain encoding."""
    if getattr(tok, "has_chat_template", False):
        messages = [{"role": "user", "content": prompt}]
        out = tok.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True
        )
        return [int(t) for t in out]
    return [int(t) for t in tok.encode(prompt)]


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
@click.option(
    "--rekey",
    is_flag=True,
    help="This machine's tier key is the fleet's (a rotation): replace session pointers "
    "tagged under another key or none, instead of reporting them as conflicts.",
)
@store_option
@json_option
def sync_cmd(
    names: tuple[str, ...],
    namespace: str | None,
    rekey: bool,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Push what the tiers (--shared, --cold) lack; fetch named sessions (--pull).

    Reports, per tier, snapshots pushed, already there and failed; exits 1 when any
    push failed (a tier down, refused, or holding another namespace secret), was held
    back (a session is pushed to --shared only after --cold, which decides its name,
    answered) or met a conflict (a session here that does not continue the tier's
    session of its name: pushed beside it as NAME~N, the tier's kept; or a value under
    its name that this machine's tier key cannot authenticate: not pushed, unless
    --rekey says this machine's key is the fleet's, as in a key rotation).  A --pull
    name is "pulled" only where the fleet's version was fetched (also over an older
    copy here that it continues), "up to date" where this store holds it already,
    and "kept here" (exit 1) where this store holds another history of the name.

    \b
    Example:
      persist sync --shared redis://127.0.0.1:6379/0 --pull work
    """
    with open_store(store_dir, create=True) as store:  # a pull may fill a new store
        if not store.tiers:
            raise InvalidArgumentError("persist sync needs --shared or --cold (or $PERSIST_*)")
        r = store.sync(namespace=namespace, pull=list(names), rekey=rekey)

    def render(_: Any) -> None:
        for tier, n in r["tiers"].items():
            click.echo(
                f"{tier}: pushed {n['pushed']}, already there {n['present']}, "
                f"failed {n['failed']} (of {r['snapshots']} snapshots)"
                + (f", held back {n['held']} until the cold tier answers" if n["held"] else "")
            )
        up = f", up to date {len(r['up_to_date'])}" if r["up_to_date"] else ""
        click.echo(f"pulled {len(r['pulled'])} sessions{up}")
        for name in r["kept_here"]:  # this store's own history of the name: not replaced
            click.echo(
                f"kept here, differs from the fleet's, not pulled: {plain(name)!r} (to take "
                f"the fleet's: persist rm {plain(name)!r} here, once it is pushed beside as "
                "NAME~N (a conflict below) or exported, then persist sync --pull again)"
            )
        if r["missing"]:
            click.echo(f"not in any tier: {plain(', '.join(r['missing']))}")
        if r["unreached"]:
            click.echo(f"a tier was down, not pulled: {plain(', '.join(r['unreached']))}")
        for why in r["unreadable"].values():  # named there, not readable here
            click.echo(f"not pulled, a tier holds it but it cannot be read: {plain(why)}")
        if r["deleted_on_fleet"]:  # a local copy of a deleted session: not pushed back
            names = plain(", ".join(r["deleted_on_fleet"]))
            click.echo(f"deleted on the fleet, not pushed back (persist rm drops it): {names}")
        for c in r["conflicts"]:
            if c["kept_as"] is None:  # a value there this machine cannot authenticate
                click.echo(
                    f"conflict: session {plain(c['session'])!r} not pushed: {plain(c['why'])}"
                )
                continue
            click.echo(
                f"conflict: session {plain(c['session'])!r} here does not continue the "
                f"{c['tier']} tier's; pushed as {plain(c['kept_as'])!r}, the tier's kept"
            )

    emit(as_json, r, render)
    if r["failed"] or r["held"]:  # a push that did not happen is not a success
        click.echo(f"persist: {r['snapshots_failed']} snapshots did not reach a tier", err=True)
    if r["unreached"]:  # nor is a pull from a tier that could not be asked
        click.echo(f"persist: {len(r['unreached'])} sessions not pulled: a tier was down", err=True)
    if r["unreadable"]:  # nor is a session the fleet holds and this machine cannot read
        click.echo(f"persist: {len(r['unreadable'])} sessions not pulled: unreadable", err=True)
    if r["kept_here"]:  # nor is a pull that left another history of the name here
        click.echo(
            f"persist: {len(r['kept_here'])} sessions not pulled: this store holds "
            "another history of the name",
            err=True,
        )
    if r["conflicts"]:  # nor is a history kept under another name
        click.echo(f"persist: {len(r['conflicts'])} sessions conflicted with a tier's", err=True)
    if r["failed"] or r["held"] or r["unreached"] or r["unreadable"] or r["kept_here"]:
        sys.exit(1)
    if r["conflicts"]:
        sys.exit(1)
