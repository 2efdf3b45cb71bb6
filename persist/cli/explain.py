"""``persist explain``: why a prompt would miss, or hit shorter than the store shares."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .app import cli, emit, json_option, open_store, store_option
from .prompts import given_prompt, prompt_file_option, prompt_option, read_prompt, utf8_argument
from .run import _adapter, _cache, _cache_options, _model, _namespace

if TYPE_CHECKING:
    from ..engine.explain import Explanation, Near


@cli.command("explain")
@_model
@_adapter
@prompt_option
@prompt_file_option
@click.option("--chat", is_flag=True, help="The prompt is one user message (chat template).")
@click.option(
    "--system-prompt", "--system", "system", default=None, callback=utf8_argument,
    help="With --chat.",
)  # fmt: skip
@click.option("--limit", type=click.IntRange(1, 100), default=5, show_default=True)
@_cache_options
@_namespace
@store_option
@json_option
def explain_cmd(
    model: str | None,
    adapter_path: str | None,
    prompt: str | None,
    prompt_file: Path | None,
    chat: bool,
    system: str | None,
    limit: int,
    namespace: str,
    store_dir: Path | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Say where a prompt diverges from what the store holds, and why a lookup
    would reuse less than the longest shared prefix (another model identity,
    a resume floor, state that cannot be cut, damage, the cost model).

    \b
    Example:
      persist explain --prompt "Where were we?"
      persist explain --model ./tiny-qwen --chat --system "Be brief." --prompt "Hi" --json
    """
    given = given_prompt(prompt, prompt_file)
    from ..apps.explain import explain_text
    from ..apps.generate import load_model

    model_, tok, identity = load_model(
        model, adapter_path=adapter_path, trust_remote_code=False, **_cache(options)
    )
    text = read_prompt(given, model_)  # bounded by the model's context
    with open_store(store_dir, create=False) as store:
        got = explain_text(
            store, tok, identity, text, chat=chat, system=system, namespace=namespace,
            limit=limit,
        )  # fmt: skip
    emit(as_json, got.to_dict(), lambda _: click.echo(render(got)))


def render(got: Explanation) -> str:
    lines = [f"prompt: {got.prompt_tokens} tokens, namespace {got.namespace!r}"]
    b = got.best
    lines.append(
        "best usable hit: none"
        if b is None
        else f"best usable hit: {b.usable} tokens of {_name(b)}"
    )
    lines.append(f"reason: {got.reason}: {got.message}")
    if got.other_namespaces:
        lines.append(f"other namespaces hold {got.other_namespaces} longer shared prefixes")
    for n in got.nearest:
        lines.append(f"  {_name(n)}: {n.shared} shared, {n.usable} usable ({n.reason})")
        if n.detail:
            lines.append(f"    {n.detail}")
        if n.text:
            where = " (at chat template markup)" if n.in_markup else ""
            lines.append(
                f"    after {n.text['before']!r}: prompt {n.text['prompt_next']!r}, "
                f"stored {n.text['stored_next']!r}{where}"
            )
    return "\n".join(lines)


def _name(n: Near) -> str:
    what = f"session {n.session!r}" if n.session else f"a {n.role}"
    return f"{what} (entry {n.id}, {n.tokens} tokens)"
