"""Tenants inside mlx-lm's server: each request's caches stay in its own namespace.

mlx-lm's server keys its prompt cache by model only, and its generation
thread never says which request an insert belongs to.  So:

- the handler (``tenant_handler``) answers 401 before the body is read when the
  request has no valid key, and hangs its namespace (tenant plus ``cache_salt``)
  on mlx-lm's ``CompletionRequest``;
- the generator (``TenantGenerator``) notes, on the generation thread, the
  namespace (and public prefix length) of the request it is preparing,
  right before mlx-lm fetches that request's cache;
- the batch generator (``TaggingBatchGenerator``) remembers each sequence's
  namespace by its uid and tags every cache it hands back for an insert
  (``Tagged``); a request served alone inserts on the thread that noted it;
- the prompt cache (``TenantPromptCache``) looks up and inserts under a ``Scoped``
  key (model, namespace): mlx-lm's trie, the host tier, the store and the shared
  tiers all key by it.  An insert whose namespace is unknown is dropped.

A request whose leading system messages are a public prefix
(``--public-prefix``) reads its system segment (mlx-lm's own cut, so the
answer is the one a fresh server computes) from the public namespace when
its own has less, and that segment's boundary snapshot is stored there.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from ..engine.skips import damaged_skips
from ..errors import AccessDeniedError
from .explaining import ExplainSlot, judge, judged, wanted
from .generation import GuardedGenerator
from .hints import SaveHints, save_hints, split_at_marks
from .penalty_context import note
from .request_checks import BadRequest
from .tenant_metrics import Counts, CountsOnce, one_lookup
from .tenants import Scoped, Tenants

__all__ = [
    "Asking",
    "Tagged",
    "TaggingBatches",
    "tagging_batches",
    "TenantGenerator",
    "TenantScoping",
    "scoped_cache",
    "tenant_handler",
]

log = logging.getLogger("persist")
_here = threading.local()  # the generation thread's request being prepared (asking, single)


@dataclass(frozen=True)
class Asking:
    """Whose request: its namespace, how many leading tokens are a public prefix, the
    retention hints of its saves, and where its verdict goes if it asked for one."""

    namespace: str
    public: int = 0
    hints: SaveHints | None = None
    explain: ExplainSlot | None = None


def _asking() -> Asking | None:
    return getattr(_here, "asking", None)


class Tagged(list[Any]):
    """A cache list handed to ``insert_cache`` with the namespace it belongs to."""

    asking: Asking | None = None

    @classmethod
    def of(cls, cache: Any, asking: Asking | None) -> Any:
        if cache is None or asking is None:
            return cache
        out = cls(cache)
        out.asking = asking
        return out


class TenantScoping(CountsOnce):
    """Over a PersistentPromptCache (``scoped_cache``): every lookup and insert is in the
    asking namespace, as a ``Scoped`` key."""

    def __init__(self, *args: Any, tenants: Tenants, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenants = tenants
        # requests' retention hints are applied (persist serve: not when tenants share
        # the store's budget, where one tenant's hints would evict another's entries)
        self.hints_honoured = True
        self.counters: Any
        self.store: Any
        self.metrics: Any

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
        ask = _asking()
        if ask is None:  # no request noted: nothing shared is safe to hand out
            self.counters.update(unscoped=1)
            return None, tokens
        try:
            # open from before the store is read until the verdict is handed over
            with self.judgements.looking() as hand:  # type: ignore[attr-defined]
                return self._looked_up(model, ask, tokens, hand)
        finally:
            self.hand_verdicts()  # type: ignore[attr-defined]
            if ask.explain is not None:
                ask.explain.ready.set()

    def _looked_up(
        self, model: Any, ask: Asking, tokens: list[int], hand: Callable[[Any], None]
    ) -> tuple[Any, list[int]]:
        own_counts: Counts = []
        pub_counts: Counts = []
        served_public = False
        try:
            lookup = super().fetch_nearest_cache  # type: ignore[misc]
            before, skips = self.store.costs.last, damaged_skips()
            # two lookups, one request: /metrics counts the one whose cache is handed out
            with self._holding() as own, self._tenant_holding(own_counts):
                cache, rest = lookup(Scoped(model, ask.namespace), tokens)
            decision = self.store.costs.last  # the store's, if it was asked (a new one)
            decision = None if decision is before else decision
            have = len(tokens) - len(rest) if cache is not None else 0
            p, seen = ask.public, own
            if 0 < p < len(tokens) and have < p:
                ns = self.tenants.public_namespace
                with self._holding() as public, self._tenant_holding(pub_counts):
                    # one token past the cut: every tier leaves a prompt's last token to prefill
                    pub, pub_rest = lookup(Scoped(model, ns), tokens[: p + 1])
                got = p + 1 - len(pub_rest) if pub is not None else 0
                if have < got <= p:  # never past the cut (another public prefix may go on)
                    cache, rest, have, seen = pub, list(tokens[got:]), got, public or own
                    served_public = True
            if self.metrics is not None:
                self.metrics.outcomes.count_once(seen, len(tokens), have)
            # damaged: a row the index offered failed its checks
            self._judge(model, ask, tokens, have, decision, damaged_skips() > skips, hand)
            note(cache, tokens[:have])  # the one handed out, not the last looked up
            return cache, rest
        finally:
            # one lookup per request in /metrics by tenant (serve.tenant_metrics)
            for ns, deltas in one_lookup(ask.namespace, own_counts, pub_counts, served_public):
                self._tenant_count(ns, deltas)

    def _judge(
        self, model: Any, ask: Asking, tokens: list[int], have: int, d: Any, damaged: bool,
        hand: Callable[[Any], None],
    ) -> None:  # fmt: skip
        """Why this lookup reused ``have`` tokens (``serve.explaining``), counted when
        not a hit and told to a request that asked: judged by the writer thread
        (``serve.judgements``; no index reads here, issue 39), or here for a request
        that waits for its verdict.  Never fails the request."""
        identity = self.identity_for(model)  # type: ignore[attr-defined]
        asked = ask.explain is not None
        if identity is None or not wanted(len(tokens), have, asked):
            return
        verdict = functools.partial(
            judge, self.store, identity, ask.namespace, list(tokens), cached=have,
            decision=d, asked=asked, damaged=damaged,
        )  # fmt: skip
        misses = self.metrics.misses if self.metrics is not None else None
        work = functools.partial(judged, verdict, misses, ask.explain)
        if not asked:
            hand(work)
            return
        with self._on_thread("explain"):  # type: ignore[attr-defined]
            work()

    def _holding(self) -> Any:
        """Hold what a lookup reports to /metrics (``serve.prompt_counts``)."""
        m = self.metrics
        return m.outcomes.holding() if m is not None else contextlib.nullcontext([])

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        ask = getattr(prompt_cache, "asking", None)
        if ask is None and getattr(_here, "single", False):
            ask = _asking()  # a request served alone inserts on the thread that noted it
        if ask is None:
            self.counters.update(unscoped=1)
            log.warning("persist: a cache of unknown namespace was not kept")
            return
        ns = self.tenants.public_namespace if 0 < ask.public == len(tokens) else ask.namespace
        plain = list(prompt_cache)
        # a tenant's hints are for its own entries, never for the public namespace's
        own = ns == ask.namespace and ask.hints is not None and self.hints_honoured
        hints = ask.hints.for_length(len(tokens)) if own and ask.hints is not None else None
        super().insert_cache(  # type: ignore[misc]
            Scoped(model, ns), tokens, plain, cache_type=cache_type, hints=hints
        )


def scoped_cache(base: type) -> type:
    """``base`` (PersistentPromptCache, which ``serve.server`` passes: no import circle)
    with ``TenantScoping`` over it."""
    return type("TenantPromptCache", (TenantScoping, base), {})


def tagging_batches(base: type) -> type:
    """``base`` (the server's BatchGenerator as persist serve patched it so far: the
    prefill timing of ``serve.prefill_rates``) that also tags the caches it hands back
    with their namespace.  Built over the patched class, not mlx-lm's own: over mlx-lm's
    it dropped the prefill timing, and the cost model learned no prefill rate."""
    return type("TaggingBatchGenerator", (TaggingBatches, base), {})


class TaggingBatches(BatchGenerator):
    """Put before another BatchGenerator subclass (``tagging_batches``): tags the caches
    it hands back with their namespace."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._asking: dict[int, Asking | None] = {}

    def insert_segments(self, *args: Any, **kwargs: Any) -> Any:
        uids = super().insert_segments(*args, **kwargs)
        for uid in uids:  # mlx-lm fetched this request's cache just before
            self._asking[uid] = _asking()
        return uids

    def extract_cache(self, uids: Any) -> Any:
        out = super().extract_cache(uids)
        return {u: (Tagged.of(c, self._asking.get(u)), t) for u, (c, t) in out.items()}

    def next(self) -> Any:
        prompts, generated = super().next()
        for r in generated:
            if r.prompt_cache is not None:
                r.prompt_cache = Tagged.of(r.prompt_cache, self._asking.get(r.uid))
            if r.finish_reason is not None:
                self._asking.pop(r.uid, None)
        return prompts, generated

    def remove(self, uids: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().remove(uids, *args, **kwargs)
        for uid in uids:
            self._asking.pop(uid, None)
        return out


class TenantGenerator(GuardedGenerator):
    """GuardedGenerator that notes whose request it prepares (``Asking``)."""

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        _here.asking = None
        out = super()._tokenize(tokenizer, request, args)
        ns = getattr(request, "persist_namespace", None)
        if ns is None:  # every request through persist's handler has one
            raise BadRequest("the request has no namespace")
        cache: TenantScoping = self.prompt_cache  # type: ignore[assignment]
        tenants = cache.tenants
        _, segments, kinds = out[0], out[1], out[2]
        public = 0
        if (
            len(segments) > 1
            and kinds[0] == "system"
            and request.request_type == "chat"
            and (
                getattr(request, "persist_public_mark", False)
                or tenants.is_public(request.messages, request.tools)
            )
        ):
            extra = getattr(self.model_provider.cli_args, "chat_template_args", None) or {}
            public = public_cut(tokenizer, request, args, len(segments[0]), extra)
        hints = None
        if getattr(request, "persist_hints", None) is not None and cache.hints_honoured:
            kwargs = dict(getattr(self.model_provider.cli_args, "chat_template_args", None) or {})
            kwargs.update(getattr(args, "chat_template_kwargs", None) or {})
            hints = save_hints(tokenizer, request, kwargs, out[0])
            if hints.marks and not self._cuttable():
                segments, kinds = split_at_marks(segments, kinds, [c for c, _ in hints.marks])
                out = (out[0], segments, kinds, *out[3:])
        _here.asking = Asking(ns, public, hints, getattr(request, "persist_explain", None))
        return out

    def _cuttable(self) -> bool:
        """Can the served model's cache be cut back to any prefix (attention only)?
        Else a mark needs a snapshot of its own (``split_at_marks``)."""
        key = self.model_provider.model_key
        if getattr(self, "_cut_for", None) != key:
            model: Any = self.model_provider.model
            self._cut = can_trim_prompt_cache(make_prompt_cache(model))
            self._cut_for = key
        return bool(self._cut)

    def _serve_single(self, request: Any, stream: Any) -> Any:
        _here.single = True
        try:
            return super()._serve_single(request, stream)
        finally:
            _here.single = False


SENTINEL = "\x00persist\x00"  # user text no template renders as it renders ""


def public_cut(tokenizer: Any, request: Any, args: Any, cut: int, extra: dict[str, Any]) -> int:
    """mlx-lm's cut after the system messages (``cut``: a fresh server prefills it
    alone), as the public prefix's length; 0 where it may hold private text.

    ``chat_template_kwargs`` are the request's own and a template may render them
    in the system block (``bos_token``, ``date_string``, documents): such a request
    is never public.  mlx-lm cuts where the prompt leaves the system messages
    rendered with an empty user turn, so a user message that begins with the
    tokens that follow an empty one (an end-of-turn token) pushes the cut into its
    text: the cut must not pass where any user text begins, found by rendering the
    system messages with two different user texts."""
    if getattr(args, "chat_template_kwargs", None):
        return 0
    system = []
    for m in request.messages:
        if not (isinstance(m, dict) and m.get("role") == "system"):
            break
        system.append(m)

    def render(text: str) -> list[int]:
        turn = [*system, {"role": "user", "content": text}]
        kw = {**extra, "tools": request.tools, "tokenize": True}
        return list(tokenizer.apply_chat_template(turn, add_generation_prompt=False, **kw))

    empty, other = render(""), render(SENTINEL)
    pairs = zip(empty, other, strict=False)  # unequal lengths: the shorter one's end
    user_starts = next((i for i, (a, b) in enumerate(pairs) if a != b), len(empty))
    return cut if 0 < cut <= user_starts else 0


def tenant_handler(base: type, tenants: Tenants) -> type:
    """``base`` (persist's handler) that admits a request only with a valid key (or the
    tenant header) and gives its CompletionRequest the request's namespace."""

    class TenantHandler(base):
        persist_tenant: str | None = None

        def do_POST(self) -> None:
            if self._admit():
                super().do_POST()

        def do_GET(self) -> None:
            if self._endpoint(("/v1/models",)) != "/v1/models" or self._admit():
                super().do_GET()

        def _admit(self) -> bool:
            try:
                self.persist_tenant = tenants.tenant(self.headers)
                return True
            except AccessDeniedError as e:
                self._refuse(401, str(e), "invalid_api_key")
            except ValueError as e:
                self._refuse(400, str(e), "invalid_tenant")
            return False

        def _refuse(self, code: int, message: str, error_code: str) -> None:
            if not self._claim():  # the reaper answered 408
                return
            self.close_connection = True  # the body is never read
            body = {"error": {"message": message, "type": "invalid_request_error",
                              "param": None, "code": error_code}}  # fmt: skip
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if code == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="persist"')
            self.end_headers()
            self.wfile.write(data)

        def _scoped(self, request: Any) -> Any:
            salt = self.body.get("cache_salt")  # a bad one: ValueError, which mlx-lm answers 400
            request.persist_namespace = tenants.namespace_for(self.persist_tenant, salt)
            request.persist_public_mark = self.persist_public_mark  # checked: allowed, a chat
            request.persist_hints = self.persist_hints
            if self.persist_explain:  # where the generation thread leaves its verdict
                self.persist_slot = request.persist_explain = ExplainSlot()
            return request

        def handle_chat_completions(self) -> Any:
            return self._scoped(super().handle_chat_completions())

        def handle_text_completions(self) -> Any:
            return self._scoped(super().handle_text_completions())

    return TenantHandler
