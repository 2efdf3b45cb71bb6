"""The generation thread of ``persist serve``: one request's exception fails that request only.

mlx-lm's ``ResponseGenerator`` runs every request on one thread; an
exception outside its per-request ``try`` (the batch loop, a stop list it
cannot hash, a prompt that tokenizes to nothing) ends that thread, and the
server then answers every later request with an error while it stays up.
``GuardedGenerator`` keeps mlx-lm's loop and:

- checks what only the loaded model can check (an empty tokenized prompt,
  ``logit_bias`` ids past the vocabulary, which crash MLX, a sampler that
  raises on the model's logits: ``check_sampling``) inside the per-request
  ``try``, before the request joins the batch, so those fail their own
  request (400) and never count against the restart budget;
- when the loop raises anyway, fails the requests it had picked up (their
  handlers get ``GenerationFailed``, 503), and starts the loop again: the
  loaded model and the prompt cache are kept, queued requests go on;
- gives up when the model cannot load, or after ``RestartBudget`` failures
  in a short window: then it is dead for good, ``generation_available()``
  is False, and ``persist serve`` drains and exits non-zero so that a
  supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from queue import Empty
from typing import Any

import mlx.core as mx
from mlx_lm.server import ResponseGenerator, _make_logits_processors, _make_sampler

from ..errors import InvalidStateError
from .bounds import capped, context_length
from .disconnect import AbandonableQueue, ClientGone, client_gone
from .quiet import RequestGate
from .request_checks import BadRequest

__all__ = ["GenerationFailed", "GuardedGenerator", "RestartBudget", "take_error_status"]

log = logging.getLogger("persist")
POLL = 0.25  # seconds a handler waits for its next response before asking about its client
_NOTHING = object()
CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection
_status = threading.local()  # the HTTP status of the last failed generate() of this thread


class GenerationFailed(InvalidStateError):
    """Generation failed while serving the request, or has stopped for good."""


class RestartBudget:
    """At most ``failures`` loop failures within ``window`` seconds (``clock`` injectable)."""

    def __init__(
        self, failures: int = 5, window: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failures, self.window, self.clock = failures, window, clock
        self._times: deque[float] = deque()

    def spend(self) -> bool:
        """Count a failure; False once more than ``failures`` fell within the window."""
        now = self.clock()
        self._times.append(now)
        while self._times and self._times[0] < now - self.window:
            self._times.popleft()
        return len(self._times) <= self.failures


def take_error_status(default: int) -> int:
    """The status for the exception this thread's last ``generate()`` raised, once."""
    status = getattr(_status, "code", None)
    _status.code = None
    return default if status is None else int(status)


def vocab_size(model: Any, tokenizer: Any) -> int:
    """The width of the model's logits (ids at or past it crash a logit bias)."""
    args = getattr(model, "args", None)
    for holder in (args, getattr(args, "text_config", None)):
        n = (
            holder.get("vocab_size")
            if isinstance(holder, dict)
            else getattr(holder, "vocab_size", 0)
        )
        if isinstance(n, int) and n > 0:
            return n
    return int(tokenizer.vocab_size)  # HF's base vocabulary: never wider than the logits


def check_sampling(args: Any, tokenizer: Any, width: int) -> None:
    """Build this request's sampler and logits processors now, and run the sampler once on
    logits of the model's width: what would raise in the shared batch step (top_k past
    the vocabulary, an XTC threshold mlx-lm refuses) fails this request alone (400)."""
    top_k = args.sampling.top_k
    if top_k and not 0 < top_k < width:
        raise BadRequest(f"top_k must be below the vocabulary size {width}, not {top_k}", "top_k")
    try:
        sampler = _make_sampler(args, tokenizer)
        _make_logits_processors(args)
        mx.eval(sampler(mx.zeros((1, width))))
    except Exception as e:  # mlx-lm checks its ranges only when the sampler first runs
        raise BadRequest(f"the sampling parameters are refused: {e}") from None


class GuardedGenerator(ResponseGenerator):
    """mlx-lm's ResponseGenerator whose thread survives a failing request."""

    gate: RequestGate | None = None  # requests in their prompt phase (``serve.quiet``)

    def __init__(
        self, model_provider: Any, prompt_cache: Any, budget: RestartBudget | None = None
    ) -> None:
        # set before super().__init__, which starts the thread
        self.budget = budget or RestartBudget()
        self.failures = 0  # loop failures survived
        self.death: str | None = None  # why generation stopped for good
        self.died = threading.Event()
        self.loaded = threading.Event()  # the default model is loaded (or never will be)
        self.abandoned = 0  # requests whose client closed its connection before the answer
        self.wasted_tokens = 0  # tokens generated for them after they were abandoned
        self._picked: weakref.WeakSet[Any] = weakref.WeakSet()  # response queues it took
        super().__init__(model_provider, prompt_cache)

    # -- the thread ------------------------------------------------------------

    def _run_generate(self) -> None:
        try:
            self.model_provider.load_default()  # a model that cannot load: no restart helps
        except Exception as e:
            self._die(f"the model did not load: {type(e).__name__}: {e}", e)
            return
        finally:
            self.loaded.set()
        while True:
            try:
                self._generate()
                return  # stop_and_join
            except Exception as e:
                self._fail_picked(e)
                if self._stop:
                    return
                if not self.budget.spend():
                    n, w = self.budget.failures, self.budget.window
                    self._die(f"more than {n} failures in {w:.0f} s; the last: {e!r}", e)
                    return
                self.failures += 1
                log.error(
                    "persist: a generation step failed; its requests get an error and "
                    "generation goes on: %r",
                    e,
                    exc_info=e,
                )

    def stop_and_join(self) -> None:
        """mlx-lm's stop and join, then a bounded wait for the thread to leave the OS."""
        super().stop_and_join()
        if not left_the_os(self._generation_thread):
            log.warning("persist: the generation thread had not exited 5 s after its join")

    def _die(self, why: str, e: BaseException) -> None:
        self.death = why
        self._generation_failed = True
        log.error("persist: generation stopped for good: %s", why, exc_info=e)
        self._fail_picked(e)
        self.died.set()

    def _fail_picked(self, e: BaseException) -> None:
        failed = GenerationFailed(f"generation failed while serving this request: {e!r}")
        for q in list(self._picked):
            q.put(failed)  # after whatever it already got; a finished one never reads it
        self._picked.clear()

    def _next_request(self, timeout: float | None = None) -> Any:
        request = super()._next_request(timeout)
        if request is not None:
            self._picked.add(request[0])
        return request

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        out = super()._tokenize(tokenizer, request, args)
        if not out[0]:
            raise BadRequest("the prompt is empty after tokenization", "prompt")
        limit = vocab_size(self.model_provider.model, tokenizer)
        bad = [k for k in args.logits.logit_bias or () if not 0 <= k < limit]
        if bad:
            raise BadRequest(
                f"logit_bias token id {bad[0]} is outside the vocabulary (0 to {limit - 1})",
                "logit_bias",
            )
        check_sampling(args, tokenizer, limit)
        args.max_tokens = capped(
            args.max_tokens, len(out[0]), context_length(self.model_provider.model)
        )
        return out

    # -- the handler threads ---------------------------------------------------

    def _take(self, q: AbandonableQueue) -> Any:
        """The request's next response; ClientGone (the request abandoned: its generation
        stops at its next token) once the watched client closed its connection."""
        try:
            while True:
                try:
                    item = q.get(timeout=POLL)
                except Empty:
                    if not self.generation_available():
                        raise GenerationFailed(self._why()) from None
                    item = _NOTHING
                if client_gone():
                    raise ClientGone("the client closed its connection")
                if item is not _NOTHING:
                    return item
        except ClientGone:
            q.abandon()
            self.abandoned += 1
            raise

    def _responses(
        self, q: AbandonableQueue, progress: Any, prompted: Callable[[], None]
    ) -> Iterator[Any]:
        """mlx-lm's response iterator, over ``_take``; ``prompted`` is called at the first
        token (or the end): the request's prompt phase is over (``serve.quiet``)."""
        n = 0
        try:
            while (response := self._take(q)) is not None:
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress is not None:
                        progress(*response)
                    continue
                prompted()
                n += 1
                yield response
        except ClientGone:
            log.info("persist: a client closed its connection; its generation stopped after "
                     "%d tokens", n)  # fmt: skip
            raise
        finally:
            prompted()

    def _waste(self) -> None:
        self.wasted_tokens += 1

    def _why(self) -> str:
        return f"generation has stopped: {self.death or 'the server is stopping'}"

    def generate(self, request: Any, generation_args: Any, progress_callback: Any = None) -> Any:
        """mlx-lm's ``generate`` over an abandonable queue: a handler thread inside
        ``disconnect.watching`` stops its request when its client leaves."""
        prompted = self.gate.enter() if self.gate is not None else _no_gate
        try:
            if not self.generation_available():
                raise GenerationFailed(self._why())
            q = AbandonableQueue(self._waste)
            self.requests.put((q, request, generation_args))
            ctx = self._take(q)
            if isinstance(ctx, Exception):
                raise ctx
            responses = self._responses(q, progress_callback, prompted)
            weakref.finalize(responses, prompted)  # a handler that never reads it
            return ctx, responses
        except Exception as e:  # mlx-lm answers 404 for all; the handler asks for this one
            prompted()
            _status.code = status_for(e)
            raise


def _no_gate() -> None:
    """No gate: nobody waits for the prompt phase to end."""


def status_for(e: Exception) -> int | None:
    """400 for what the request's own content raised before generation (a chat template
    or tokenizer refusing it), 503 once generation failed; None: mlx-lm's 404."""
    if isinstance(e, GenerationFailed):
        return 503
    if isinstance(e, ClientGone):
        return CLIENT_CLOSED
    if isinstance(e, (BadRequest, ValueError, TypeError, KeyError, IndexError)):
        return 400
    return None


def left_the_os(thread: threading.Thread, timeout: float = 5.0) -> bool:
    """Wait until a joined ``thread`` is gone from the OS (False: still there after
    ``timeout`` seconds).  ``join`` returns when its Python part has ended; its C++
    thread-locals are freed after, and MLX's compile cache among them takes the GIL to
    release the compiled Python functions (the model's, mlx-lm's samplers').  A
    process that finalized first was aborted by that thread's exit ("terminate
    called without an active exception", SIGABRT after `persist serve`'s stop line).
    Where there is no /proc/self/task to look in, nothing to wait for is known."""
    tid = thread.native_id
    if tid is None or not os.path.isdir("/proc/self/task"):
        return True
    task = f"/proc/self/task/{tid}"
    deadline = time.monotonic() + timeout
    while os.path.exists(task):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # lets that thread take the GIL for its thread-locals
    return True
