"""Generate with resume, and prime a session: the library behind the CLI.

A session is a token transcript: each prompt's text is appended to the
tokens the session already covers, the model generates, and the session is
saved covering prompt and answer.  Before computing anything, persist
restores the session (or, for a new session, the longest stored prefix of
the prompt from any session), so only new tokens are prefilled.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..engine.cache_fit import refuse_unfit_kv_bits
from ..engine.prefill import prefill
from ..engine.store import Store
from ..errors import InvalidArgumentError, ModelNotFoundError
from ..identity import ModelIdentity
from ..records import Progress
from .decoding import Run, Sampling
from .resume import chat_metadata, resume_chat, resume_text, save_turn

__all__ = ["GenerateResult", "PrimeResult", "Sampling", "load_model", "generate", "prime"]

Bars = Callable[[str], Progress]  # a progress callback per phase ("restore", "prefill", ...)


@dataclass(frozen=True)
class GenerateResult:
    session: str
    text: str
    prompt_tokens: int  # tokens the model had to see for this turn (history included)
    reused_tokens: int  # of those, restored from the store
    source: str  # "session", "prefix" or "none"
    generated_tokens: int
    first_token_seconds: float
    generate_seconds: float
    session_tokens: int  # the session's length after this turn
    # the session it was asked for when it changed meanwhile (the turn went to ``session``)
    conflict_with: str | None = None
    # restore or recompute (``policy.CostDecision`` as a map), when a lookup was made
    decision: dict[str, Any] | None = None
    sampling: dict[str, Any] | None = None  # the Sampling the turn's tokens were drawn with
    # stopped early (``should_stop``): the turn so far was saved, if anything new was computed
    interrupted: bool = False
    saved: bool = True  # False: interrupted before anything new was computed, nothing saved

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PrimeResult:
    session: str
    tokens: int
    checkpoints: int
    seconds: float
    reused_tokens: int = 0  # resumed from a checkpoint or prefix (an interrupted prime)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_model(
    model: str | os.PathLike[str] | None,
    *,
    adapter_path: str | os.PathLike[str] | None = None,
    trust_remote_code: bool = False,
    **cache_config: int | None,
) -> tuple[Any, Any, ModelIdentity]:
    """(model, tokenizer, identity) of a folder or Hugging Face repo id (``hub``); the
    built-in demo model when ``model`` is None.  ``cache_config`` (kv_bits,
    kv_group_size, quantized_kv_start, max_kv_size) changes what the caches hold,
    so it is part of the identity, and ``generate`` builds its caches from it."""
    from ..provenance import load_model as load
    from .hub import resolve_model

    path = resolve_model(model)
    adapter = None if adapter_path is None else str(adapter_path)
    try:
        loaded = load(  # stamped: its identity may use the remembered digest
            path,
            adapter,
            tokenizer_config={"trust_remote_code": trust_remote_code},
            trust_remote_code=trust_remote_code,
        )
    except OSError as e:  # mlx-lm's word for a file it needs and cannot read (no weights)
        also = f" with the adapter {adapter}" if adapter else ""
        raise ModelNotFoundError(f"the model {path}{also}: mlx-lm cannot load it: {e}") from None
    m, tok = loaded[0], loaded[1]
    wanted: dict[str, Any] = {k: v for k, v in cache_config.items() if v is not None}
    name = None if model is None or Path(os.fspath(model)).is_dir() else os.fspath(model)
    ident = ModelIdentity.of(m, tok, name=name, path=path, adapter_path=adapter, **wanted)
    refuse_unfit_kv_bits(m, ident)  # rings, groups: mlx-lm would fail mid-prompt
    return m, tok, ident


def generate(
    model: Any,
    tokenizer: Any,
    identity: ModelIdentity,
    store: Store,
    *,
    session: str,
    prompt: str,
    max_tokens: int = 64,
    sampling: Sampling | None = None,
    namespace: str = "default",
    on_text: Callable[[str], None] | None = None,
    bars: Bars | None = None,
    chat: bool = False,
    system: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    prefill_step_size: int = 2048,
    should_stop: Callable[[], bool] | None = None,
    new: bool = False,
) -> GenerateResult:
    """Resume ``session`` (or the best stored prefix), append ``prompt``, generate, save.

    With ``chat`` the prompt is a user message rendered by the tokenizer's chat
    template (``system`` opens a new chat; ``template_kwargs`` go to
    ``apply_chat_template``, as mlx_lm.generate's --chat-template-config), and
    the session keeps its messages.  The caches follow ``identity.cache_config``
    (kv_bits and max_kv_size, as ``load_model`` set them).  ``should_stop`` is asked
    between prefill chunks and after every token: once it says True the turn ends there
    and what the caches hold (the prompt prefilled so far, the answer so far) is saved
    as the session's next version, which the next turn continues (``interrupted``).
    ``new``: start a new conversation under ``session`` without asking for the one the
    store or a tier holds (saved beside it as ``session~N`` if one exists here).
    """
    if system is not None and not chat:
        raise InvalidArgumentError("--system needs --chat")
    t0 = time.perf_counter()

    def bar(phase: str) -> Progress | None:
        return bars(phase) if bars is not None else None

    messages: list[dict[str, str]] = []
    if chat:
        got, messages = resume_chat(
            store,
            session,
            tokenizer,
            prompt=prompt,
            system=system,
            identity=identity,
            namespace=namespace,
            bar=bar("restore"),
            template_kwargs=template_kwargs,
            fresh=new,
        )
    else:
        prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        got = resume_text(
            store,
            session,
            prompt_ids,
            identity=identity,
            namespace=namespace,
            bar=bar("restore"),
            fresh=new,
        )
    if len(got.tokens) == got.covered:
        raise InvalidArgumentError("the prompt is empty after tokenization")
    tokens, covered = got.tokens, got.covered
    decision = store.costs.last
    sampling = sampling or Sampling()
    cache = got.cache if got.cache is not None else _new_cache(model, identity)
    run = Run(
        model,
        tokenizer,
        identity=identity,
        sampling=sampling,
        prefill_step_size=prefill_step_size,
        should_stop=should_stop,
    )
    started = time.perf_counter()
    got_run = run(
        tokens[covered:], cache, max_tokens=max_tokens, bar=bar("prefill"), on_text=on_text, t0=t0
    )
    out, text, first = got_run.tokens, got_run.text, got_run.first
    elapsed = time.perf_counter() - t0
    if out:  # the prompt's forward (and one step) until the first token: a prefill rate
        store.record_prefill(identity, covered, len(tokens), t0 + first - started)
    if got_run.prefilled is not None:  # stopped inside the prefill: the prompt so far
        tokens = tokens[: covered + got_run.prefilled]
    result = GenerateResult(
        session=session,
        text=text,
        prompt_tokens=len(tokens),
        reused_tokens=covered,
        source=got.source,
        generated_tokens=len(out),
        first_token_seconds=first,
        generate_seconds=elapsed,
        session_tokens=len(tokens) + len(out),
        decision=None if decision is None else asdict(decision),
        sampling=asdict(sampling),
        interrupted=got_run.stopped,
    )
    if got_run.stopped and len(tokens) + len(out) <= covered:
        return replace(result, saved=False)  # nothing new was computed: nothing to keep
    saved_as = save_turn(
        store,
        cache,
        tokens + out,
        identity=identity,
        session=session,
        namespace=namespace,
        version=got.version,
        metadata=chat_metadata(messages, text) if chat else None,
        progress=bar("save"),
        unverified=got.unverified,
    )
    return replace(result, session=saved_as, conflict_with=session if saved_as != session else None)


def _new_cache(model: Any, identity: ModelIdentity) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    # as mlx-lm: a ring of max_kv_size for a model without caches of its own
    return list(
        make_prompt_cache(model, max_kv_size=dict(identity.cache_config).get("max_kv_size"))
    )


def prime(
    model: Any,
    tokenizer: Any,
    identity: ModelIdentity,
    store: Store,
    *,
    session: str,
    text: str,
    checkpoint_every: int | None = None,
    namespace: str = "default",
    bars: Bars | None = None,
) -> PrimeResult:
    """Prefill ``text`` into a new session, leaving checkpoints every N tokens."""
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    if not tokens:
        raise InvalidArgumentError("the prompt is empty after tokenization")
    t0 = time.perf_counter()
    before = {e.id for e in store.entries(namespace)}
    # An interrupted prime left checkpoints: continue from the deepest usable one
    # (or any stored prefix) instead of computing and storing them again.
    hit = store.lookup(tokens, identity=identity, namespace=namespace)
    cache = prefill(
        model,
        tokens,
        cache=None if hit is None else hit.cache,
        store=store,
        identity=identity,
        session=session,
        namespace=namespace,
        checkpoint_every=checkpoint_every,
        progress=bars("prefill") if bars else None,
    )
    store.save(
        cache,
        tokens,
        identity=identity,
        session=session,
        namespace=namespace,
        progress=bars("save") if bars else None,
    )
    made = [e for e in store.entries(namespace) if e.id not in before and e.role == "checkpoint"]
    reused = 0 if hit is None else len(hit.tokens)
    return PrimeResult(session, len(tokens), len(made), time.perf_counter() - t0, reused)
