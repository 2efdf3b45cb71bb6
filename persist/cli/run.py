"""``persist generate`` and ``persist prime``: run a model with the store behind it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # generation imports mlx-lm: loaded by these commands only
    from ..apps.generate import GenerateResult, PrimeResult
from .app import cli, complete_sessions, emit, json_option, open_store, plain, store_option
from .interrupts import deferred_sigint
from .prompts import given_prompt, prompt_file_option, prompt_option, read_prompt, utf8_argument
from .terminal import end_line, progress, stdout_closed, write_answer

_model = click.option(
    "--model",
    default=None,
    metavar="PATH_OR_REPO",
    help="The model's folder or a Hugging Face repo id, as mlx-lm takes it "
    "(default: the built-in demo model).",
)
_adapter = click.option(
    "--adapter-path", default=None, help="Trained LoRA adapter weights and config (mlx-lm's)."
)
_session = click.option(
    "--session",
    required=True,
    shell_complete=complete_sessions,
    help="Session name (any text).",
)
_namespace = click.option(
    "--namespace",
    default="default",
    show_default=True,
    help="Tenant namespace: no sharing or hits across namespaces.",
)


def _render_generate(r: GenerateResult) -> None:
    end_line()  # the streamed answer has no newline of its own
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


_prompt = prompt_option
_prompt_file = prompt_file_option


def _sampling_options(f: Any) -> Any:
    """mlx_lm.generate's sampling options: same names, meanings and defaults."""
    opts = [
        ("--temp", click.FloatRange(0.0), 0.0, "Sampling temperature (0: greedy)."),
        ("--top-p", click.FloatRange(0.0, 1.0), 1.0, "Sampling top-p."),
        ("--min-p", click.FloatRange(0.0, 1.0), 0.0, "Sampling min-p."),
        ("--top-k", click.IntRange(0), 0, "Sampling top-k (0: off)."),
        ("--min-tokens-to-keep", click.IntRange(1), 1, "Minimum tokens to keep for min-p."),
        ("--xtc-probability", click.FloatRange(0.0, 1.0), 0.0, "Probability of XTC sampling."),
        ("--xtc-threshold", click.FloatRange(0.0, 0.5), 0.1, "XTC's probability threshold."),
        ("--seed", int, None, "PRNG seed."),
    ]
    for name, kind, default, text in reversed(opts):
        f = click.option(name, type=kind, default=default, show_default=True, help=text)(f)
    return f


def _cache_options(f: Any) -> Any:
    """mlx_lm.generate's cache options: they change what the caches hold, so they
    are part of the model identity (a session continues only with the same ones)."""
    opts = [
        (
            "--kv-bits",
            click.IntRange(1, 8),
            None,
            "Bits for KV cache quantization (default: none).",
        ),
        ("--kv-group-size", click.IntRange(1), 64, "Group size for KV cache quantization."),
        ("--quantized-kv-start", click.IntRange(0), 5000, "With --kv-bits: quantize from here."),
        ("--max-kv-size", click.IntRange(1), None, "The maximum key-value cache size."),
    ]
    for name, kind, default, text in reversed(opts):
        f = click.option(name, type=kind, default=default, show_default=True, help=text)(f)
    return f


@cli.command("generate")
@_model
@_adapter
@_session
@_prompt
@_prompt_file
@click.option("--max-tokens", "-m", type=click.IntRange(1, 1 << 20), default=64, show_default=True)
@_sampling_options
@_cache_options
@click.option(
    "--prefill-step-size",
    type=click.IntRange(1),
    default=2048,
    show_default=True,
    help="Prompt tokens processed at a time.",
)
@click.option(
    "--extra-eos-token", multiple=True, help="A token that also ends the answer (repeatable)."
)
@click.option(
    "--chat",
    is_flag=True,
    help="The session is a conversation: the prompt is a user message (chat template).",
)
@click.option(
    "--system-prompt", "--system", "system", default=None, callback=utf8_argument,
    help="With --chat: the system prompt of a new chat.",
)  # fmt: skip
@click.option(
    "--chat-template-config",
    default=None,
    callback=utf8_argument,
    help="With --chat: JSON of further apply_chat_template arguments.",
)
@click.option("--trust-remote-code", is_flag=True, help="Trust remote code for the tokenizer.")
@click.option(
    "--new",
    "new",
    is_flag=True,
    help="Start a new conversation under --session without asking for the one the store "
    "or a tier holds (kept beside it as NAME~2 if one exists).",
)
@click.option(
    "--max-cost",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds a stored prefix may take to restore (default: less than its prefill).",
)
@_namespace
@store_option
@json_option
def generate_cmd(
    model: str | None,
    adapter_path: str | None,
    session: str,
    prompt: str | None,
    prompt_file: Path | None,
    max_tokens: int,
    prefill_step_size: int,
    extra_eos_token: tuple[str, ...],
    chat: bool,
    system: str | None,
    chat_template_config: str | None,
    trust_remote_code: bool,
    new: bool,
    max_cost: float | None,
    namespace: str,
    store_dir: Path | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Resume a session (or the best stored prefix), generate, save the session.

    Only tokens the store does not already hold are prefilled; the text is
    streamed as it is generated.  Without --chat a session is a transcript
    (each prompt appended as text); with --chat it is a conversation, and a
    new chat with the same --system-prompt reuses it.  The model and sampling
    options are mlx_lm.generate's.

    \b
    Example:
      persist generate --session work --prompt "Where were we?" --max-tokens 32
      persist generate --model mlx-community/Llama-3.2-1B-Instruct-4bit \\
          --session c1 --chat --system-prompt "Be brief." --prompt "Hi"
      cat notes.txt | persist generate --session notes --prompt - --temp 0.7 --seed 1
    """
    if system is not None and not chat:
        raise click.UsageError("--system-prompt / --system needs --chat")
    if chat_template_config is not None and not chat:
        raise click.UsageError("--chat-template-config needs --chat")
    template = _template_kwargs(chat_template_config)
    given = given_prompt(prompt, prompt_file)
    from ..apps.generate import Sampling, generate, load_model

    sampling = Sampling(**{k: options.pop(k) for k in list(options) if k in SAMPLING})
    model_, tok, identity = load_model(
        model, adapter_path=adapter_path, trust_remote_code=trust_remote_code, **_cache(options)
    )
    text = read_prompt(given, model_)  # bounded by the model's context
    for t in extra_eos_token:
        tok.add_eos_token(t)
    with open_store(store_dir, create=True) as store, deferred_sigint() as stop:
        store.costs.max_cost = max_cost  # the limit of every prefix hit of this run
        r = generate(
            model_,
            tok,
            identity,
            store,
            session=session,
            prompt=text,
            max_tokens=max_tokens,
            sampling=sampling,
            namespace=namespace,
            on_text=None if as_json else write_answer,
            bars=progress,
            chat=chat,
            system=system,
            template_kwargs=template,
            prefill_step_size=prefill_step_size,
            should_stop=stop,
            new=new,
        )
    emit(as_json, r.to_dict(), lambda _: _render_generate(r))
    _say_kept(r)


def _say_kept(r: GenerateResult) -> None:
    """What a turn cut short kept, on stderr: a closed stdout (the turn was saved all
    the same), Ctrl-C (the turn so far, then exit 130)."""
    if stdout_closed():
        click.echo(
            f"persist: stdout was closed before the whole answer was written; the turn "
            f"was saved as session {plain(r.session)!r} ({r.session_tokens} tokens)",
            err=True,
        )
    if not r.interrupted:
        return
    end_line()
    if r.saved:
        new = r.prompt_tokens - r.reused_tokens
        click.echo(
            f"persist: interrupted; kept the turn so far as session {plain(r.session)!r}: "
            f"{r.session_tokens} tokens ({new} prompt tokens prefilled, "
            f"{r.generated_tokens} generated); the next generate continues it",
            err=True,
        )
    else:
        click.echo("persist: interrupted before anything new was computed; nothing saved", err=True)
    sys.exit(130)


SAMPLING = (
    "temp", "top_p", "min_p", "top_k", "min_tokens_to_keep", "xtc_probability",
    "xtc_threshold", "seed",
)  # fmt: skip


def _cache(options: dict[str, Any]) -> dict[str, int | None]:
    """The identity's cache configuration: the quantization settings only with --kv-bits
    (without it they change nothing, as in mlx-lm)."""
    out = {"max_kv_size": options.get("max_kv_size"), "kv_bits": options.get("kv_bits")}
    if out["kv_bits"] is not None:
        out["kv_group_size"] = options.get("kv_group_size")
        out["quantized_kv_start"] = options.get("quantized_kv_start")
    return out


def _template_kwargs(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    import json

    try:
        got = json.loads(text)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--chat-template-config") from None
    if not isinstance(got, dict):
        raise click.BadParameter("give a JSON object", param_hint="--chat-template-config")
    return got


@cli.command("prime")
@_model
@_adapter
@_session
@_prompt
@_prompt_file
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
    model: str | None,
    adapter_path: str | None,
    session: str,
    prompt: str | None,
    prompt_file: Path | None,
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
    given = given_prompt(prompt, prompt_file)
    from ..apps.generate import load_model, prime

    model_, tok, identity = load_model(model, adapter_path=adapter_path)
    text = read_prompt(given, model_)  # bounded by the model's context
    with open_store(store_dir, create=True) as store:
        r: PrimeResult = prime(
            model_,
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
