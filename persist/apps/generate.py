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
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..engine.cache_fit import refuse_unfit_kv_bits
from ..engine.prefill import prefill
from ..engine.store import Store
from ..errors import InvalidArgumentError
from ..identity import ModelIdentity
from ..records import Progress
from .resume import chat_metadata, resume_chat, resume_text, save_turn

__all__ = ["GenerateResult", "PrimeResult", "Sampling", "load_model", "generate", "prime"]

Bars = Callable[[str], Progress]  # a progress callback per phase ("restore", "prefill", ...)


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: mlx_lm.generate's sampling options, same names and defaults.

    None of them changes what a cache holds (the cache covers the tokens, however
    they were drawn), so none is in the identity; they are reported with the turn."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    seed: int | None = None

    def sampler(self, tokenizer: Any) -> Callable[[Any], Any]:
        from mlx_lm.sample_utils import make_sampler

        if self.seed is not None:
            mx.random.seed(self.seed)
        return make_sampler(
            self.temp,
            self.top_p,
            self.min_p,
            self.min_tokens_to_keep,
            top_k=self.top_k,
            xtc_probability=self.xtc_probability,
            xtc_threshold=self.xtc_threshold,
            xtc_special_tokens=list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids),
        )


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
    loaded = load(  # stamped: its identity may use the remembered digest
        path,
        adapter,
        tokenizer_config={"trust_remote_code": trust_remote_code},
        trust_remote_code=trust_remote_code,
    )
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
    run = _Run(
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


@dataclass(frozen=True)
class _Ran:
    """What a run left: the answer's tokens and text, seconds to the first token, and
    whether it was stopped (``prefilled``: stopped inside the prefill after so many of
    the prompt's tokens, which the caches then hold; None: the prefill ran whole)."""

    tokens: list[int]
    text: str
    first: float
    stopped: bool = False
    prefilled: int | None = None

    def __iter__(self) -> Iterator[Any]:
        # unpacks as the (tokens, text, first) a run returned before it could stop
        return iter((self.tokens, self.text, self.first))


class _PrefillStopped(Exception):
    """Asked to stop between two prefill chunks (the caches hold ``done`` prompt tokens)."""

    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


@dataclass(frozen=True)
class _Run:
    """mlx-lm's generate_step with the identity's cache options and the sampling."""

    model: Any
    tokenizer: Any
    _: KW_ONLY
    identity: ModelIdentity
    sampling: Sampling
    prefill_step_size: int
    should_stop: Callable[[], bool] | None = None

    def _progress(self, bar: Progress | None) -> Progress:
        """The prefill's callback: the bar, then a stop between chunks.  Never at the
        last report (done == total): generate_step makes it after feeding the first
        answer token, which is not yielded yet."""

        def report(done: int, total: int) -> None:
            if bar is not None:
                bar(done, total)
            if done < total and self.should_stop is not None and self.should_stop():
                raise _PrefillStopped(done)

        return report

    def __call__(
        self,
        prompt: list[int],
        cache: list[Any],
        *,
        max_tokens: int,
        bar: Progress | None,
        on_text: Callable[[str], None] | None,
        t0: float,
    ) -> _Ran:
        from mlx_lm.generate import generate_step

        cfg = dict(self.identity.cache_config)
        steps = generate_step(
            mx.array(prompt),
            self.model,
            prompt_cache=cache,
            max_tokens=max_tokens,
            sampler=self.sampling.sampler(self.tokenizer),
            prompt_progress_callback=self._progress(bar),
            prefill_step_size=self.prefill_step_size,
            kv_bits=cfg.get("kv_bits"),
            kv_group_size=cfg.get("kv_group_size", 64),
            quantized_kv_start=cfg.get("quantized_kv_start", 5000),
        )
        try:
            return _decode(steps, self.tokenizer, on_text, t0, self.should_stop)
        except _PrefillStopped as e:
            return _Ran([], "", 0.0, stopped=True, prefilled=e.done)
        except ValueError as e:  # mlx's quantize refuses a group size the heads do not divide
            if "kv_bits" not in cfg or "quantiz" not in str(e):
                raise
            raise InvalidArgumentError(
                f"--kv-bits {cfg['kv_bits']} --kv-group-size {cfg.get('kv_group_size', 64)} "
                f"do not fit this model's caches: {str(e).splitlines()[0]}"
            ) from None


def _decode(
    steps: Any,
    tokenizer: Any,
    on_text: Callable[[str], None] | None,
    t0: float,
    should_stop: Callable[[], bool] | None = None,
) -> _Ran:
    """Run the generation steps to the end, an EOS or a stop (``should_stop``, asked
    after each token: every token yielded is in the caches already)."""
    detok = tokenizer.detokenizer
    detok.reset()
    out: list[int] = []
    first = 0.0
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    stopped = False
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
        if should_stop is not None and should_stop():
            stopped = True
            break
    detok.finalize()
    segment = detok.last_segment
    if on_text is not None and segment:
        on_text(segment)
    return _Ran(out, detok.text, first, stopped)


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
