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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..engine.prefill import prefill
from ..engine.store import Store
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from ..records import Progress
from .resume import chat_metadata, resume_chat, resume_text, save_turn

__all__ = ["GenerateResult", "PrimeResult", "load_model", "generate", "prime"]

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


def load_model(model_dir: str | os.PathLike[str] | None) -> tuple[Any, Any, ModelIdentity]:
    """(model, tokenizer, identity); the built-in demo model when ``model_dir`` is None."""
    from mlx_lm import load

    from .demo import demo_model_dir

    path = Path(model_dir) if model_dir is not None else demo_model_dir()
    model, tok = load(str(path))[:2]
    return model, tok, ModelIdentity.of(model, tok, path=path)


def generate(
    model: Any,
    tokenizer: Any,
    identity: ModelIdentity,
    store: Store,
    *,
    session: str,
    prompt: str,
    max_tokens: int = 64,
    temp: float = 0.0,
    namespace: str = "default",
    on_text: Callable[[str], None] | None = None,
    bars: Bars | None = None,
    chat: bool = False,
    system: str | None = None,
) -> GenerateResult:
    """Resume ``session`` (or the best stored prefix), append ``prompt``, generate, save.

    With ``chat`` the prompt is a user message rendered by the tokenizer's chat
    template (``system`` opens a new chat), and the session keeps its messages.
    """
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    if system is not None and not chat:
        raise InvalidArgumentError("--system needs --chat")
    t0 = time.perf_counter()

    def bar(phase: str) -> Progress | None:
        return bars(phase) if bars is not None else None

    messages: list[dict[str, str]] = []
    if chat:
        got, messages = resume_chat(
            store, session, tokenizer, prompt, system, identity, namespace, bar("restore")
        )
    else:
        new = list(tokenizer.encode(prompt, add_special_tokens=False))
        got = resume_text(store, session, new, identity, namespace, bar("restore"))
    if len(got.tokens) == got.covered:
        raise InvalidArgumentError("the prompt is empty after tokenization")
    tokens, covered = got.tokens, got.covered
    decision = store.costs.last
    cache = make_prompt_cache(model) if got.cache is None else got.cache
    steps = generate_step(
        mx.array(tokens[covered:]),
        model,
        prompt_cache=cache,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temp),
        prompt_progress_callback=bar("prefill"),
    )
    started = time.perf_counter()
    out, text, first = _decode(steps, tokenizer, on_text, t0)
    elapsed = time.perf_counter() - t0
    if out:  # the prompt's forward (and one step) until the first token: a prefill rate
        store.record_prefill(identity, covered, len(tokens), t0 + first - started)
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
    )
    return GenerateResult(
        session=saved_as,
        text=text,
        prompt_tokens=len(tokens),
        reused_tokens=covered,
        source=got.source,
        generated_tokens=len(out),
        first_token_seconds=first,
        generate_seconds=elapsed,
        session_tokens=len(tokens) + len(out),
        conflict_with=session if saved_as != session else None,
        decision=None if decision is None else asdict(decision),
    )


def _decode(
    steps: Any, tokenizer: Any, on_text: Callable[[str], None] | None, t0: float
) -> tuple[list[int], str, float]:
    """Run the generation steps to the end or an EOS: (tokens, text, seconds to the first)."""
    detok = tokenizer.detokenizer
    detok.reset()
    out: list[int] = []
    first = 0.0
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for tok, _ in steps:
        if not out:
            first = time.perf_counter() - t0
        out.append(int(tok))  # generate_step fed it to the cache before yielding it
        if int(tok) in eos:
            break
        detok.add_token(int(tok))
        segment = detok.last_segment  # reading it consumes it
        if on_text is not None and segment:
            on_text(segment)
    detok.finalize()
    segment = detok.last_segment
    if on_text is not None and segment:
        on_text(segment)
    return out, detok.text, first


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
