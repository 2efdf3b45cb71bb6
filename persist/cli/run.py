"""``persist generate`` and ``persist prime``: run a model with the store behind it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # generation imports mlx-lm: loaded by these commands only
    from ..apps.generate import GenerateResult, PrimeResult
from .app import cli, emit, json_option, open_store, plain, progress, store_option

_model = click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="mlx-lm model directory (default: the built-in demo model).",
)
_session = click.option("--session", required=True, help="Session name (any text).")
_namespace = click.option(
    "--namespace",
    default="default",
    show_default=True,
    help="Tenant namespace: no sharing or hits across namespaces.",
)


def _render_generate(r: GenerateResult, streamed: bool) -> None:
    if not streamed:
        click.echo(r.text)
    else:
        click.echo()
    click.echo(
        f"[{plain(r.session)}] {r.reused_tokens} of {r.prompt_tokens} prompt tokens from the store "
        f"({r.source}); first token after {r.first_token_seconds:.3f} s; "
        f"{r.generated_tokens} tokens generated; session now {r.session_tokens} tokens",
        err=True,
    )
    if r.conflict_with is not None:
        click.echo(
            f"persist: session {r.conflict_with!r} changed while this turn ran; "
            f"this turn is saved as {r.session!r}",
            err=True,
        )


@cli.command("generate")
@_model
@_session
@click.option("--prompt", required=True, help="Text appended to the session.")
@click.option("--max-tokens", type=click.IntRange(1, 1 << 20), default=64, show_default=True)
@click.option(
    "--temp",
    type=click.FloatRange(0.0),
    default=0.0,
    show_default=True,
    help="Sampling temperature (0: greedy).",
)
@click.option(
    "--chat",
    is_flag=True,
    help="The session is a conversation: the prompt is a user message (chat template).",
)
@click.option("--system", default=None, help="With --chat: the system prompt of a new chat.")
@_namespace
@store_option
@json_option
def generate_cmd(
    model_dir: Path | None,
    session: str,
    prompt: str,
    max_tokens: int,
    temp: float,
    chat: bool,
    system: str | None,
    namespace: str,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Resume a session (or the best stored prefix), generate, save the session.

    Only tokens the store does not already hold are prefilled; the text is
    streamed as it is generated.  Without --chat a session is a transcript
    (each prompt appended as text); with --chat it is a conversation, and a
    new chat with the same --system prompt reuses it.

    \b
    Example:
      persist generate --session work --prompt "Where were we?" --max-tokens 32
      persist generate --session c1 --chat --system "Be brief." --prompt "Hi"
    """
    if system is not None and not chat:
        raise click.UsageError("--system needs --chat")
    from ..apps.generate import generate, load_model

    model, tok, identity = load_model(model_dir)
    with open_store(store_dir) as store:

        def write(text: str) -> None:
            click.echo(text, nl=False)

        r = generate(
            model,
            tok,
            identity,
            store,
            session=session,
            prompt=prompt,
            max_tokens=max_tokens,
            temp=temp,
            namespace=namespace,
            on_text=None if as_json else write,
            bars=progress,
            chat=chat,
            system=system,
        )
    emit(as_json, r.to_dict(), lambda _: _render_generate(r, streamed=True))


@cli.command("prime")
@_model
@_session
@click.option("--prompt", default=None, help="Text to prefill.")
@click.option("--prompt-file", type=click.File("r"), default=None, help="File to prefill.")
@click.option(
    "--checkpoint-every",
    type=click.IntRange(1),
    default=None,
    help="Save a checkpoint every N tokens (lets recurrent models reuse prefixes).",
)
@_namespace
@store_option
@json_option
def prime_cmd(
    model_dir: Path | None,
    session: str,
    prompt: str | None,
    prompt_file: object,
    checkpoint_every: int | None,
    namespace: str,
    store_dir: Path | None,
    as_json: bool,
) -> None:
    """Prefill a long prompt into a new session, with checkpoints along the way.

    \b
    Example:
      persist prime --model ./tiny-qwen --session docs --prompt-file manual.txt \\
          --checkpoint-every 256
    """
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    text = prompt if prompt is not None else prompt_file.read()  # type: ignore[attr-defined]
    from ..apps.generate import load_model, prime

    model, tok, identity = load_model(model_dir)
    with open_store(store_dir) as store:
        r: PrimeResult = prime(
            model,
            tok,
            identity,
            store,
            session=session,
            text=text,
            checkpoint_every=checkpoint_every,
            namespace=namespace,
            bars=progress,
        )
    emit(
        as_json,
        r.to_dict(),
        lambda _: click.echo(
            f"primed session {r.session!r}: {r.tokens} tokens ({r.reused_tokens} resumed "
            f"from the store), {r.checkpoints} new checkpoints, {r.seconds:.2f} s"
        ),
    )
