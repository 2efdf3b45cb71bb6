"""Copying what mlx-lm evicts into the host tier, off mlx-lm's generation thread.

mlx-lm evicts inside its prompt cache's insert, and its server inserts at the
end of every prompt segment: in the middle of a request's prompt processing.
On a GPU, keeping an evicted 1 GiB cache in pinned host pages (growing the
pinned pool, then a device-to-host copy) took 0.43 s per cache on an H100 (the
e2e benchmark's ``/metrics``, step ``keep``), all of it added to that request's
time to first token.  Here the generation thread only evaluates the evicted
cache (``handoff.handed_off``, as for an insert: a batch's lazy slice is
computed on the stream it was made on) and hands it over; one thread of its own
copies it, on a stream of its own
(``handoff.writer_stream``).  Safe for the reason the write-behind is: an
evaluated MLX array never changes, and mlx-lm no longer holds an evicted cache.

A lookup first waits for its own owner's hand-overs in flight that could serve it
(``settle``, given its prompt and what memory already gives it): the host tier
answers as if the keep had been made in place.  A prompt that none of them
serves ``gain`` tokens further than memory (a store block), or half of what
memory leaves to prefill where that is less, does not wait (issue 39: a miss
waited for the previous request's 1 GiB copy, about 36 ms a request on an
H100, and one sharing only a chat template's tokens with it still did:
prefilling them costs less than the wait).  While a request is in its prompt
phase the copy waits to start (``serve.quiet.RequestGate``, at most its
``hold``), unless a lookup is waiting for it.  At most
``size`` evicted caches wait (their device memory is what eviction meant to
free); one more is not kept (``dropped``; the write-behind's store copy still
serves it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..engine.host.tier import HostTier
from .handoff import writer_stream
from .quiet import RequestGate

__all__ = ["EvictionKeeper"]

log = logging.getLogger("persist")

Kept = tuple[int, str, list[int], list[Any], "tuple[float, int] | None"]


class EvictionKeeper:
    """One thread that keeps evicted caches in ``host``; ``on_error`` hears its failures."""

    def __init__(
        self,
        host: HostTier,
        *,
        size: int = 2,
        on_error: Callable[[Exception], None] | None = None,
        gate: RequestGate | None = None,
        gain: int = 1,
    ) -> None:
        self.host, self.on_error = host, on_error
        self.gate, self.gain = gate, max(1, gain)
        self.dropped = 0
        self.holding = 0  # copies waiting for a request's prompt phase now (tests)
        self._settling = 0  # lookups waiting for a copy in flight: it starts at once
        self._queue: queue.Queue[Kept | None] = queue.Queue(size)
        self._lock = threading.Lock()
        # each hand-over's owner and tokens, by its number
        self._inflight: dict[int, tuple[str, np.ndarray]] = {}
        self._done = threading.Condition(self._lock)
        self._next = 0
        self._thread = threading.Thread(target=self._run, name="persist-keeper", daemon=True)
        self._thread.start()

    def offer(
        self,
        owner: str,
        tokens: Sequence[int],
        cache: Sequence[Any],
        hints: tuple[float, int] | None = None,
    ) -> bool:
        """Hand an evicted cache over; False (counted in ``dropped``) when ``size``
        caches already wait.  Never blocks the caller."""
        with self._lock:
            n, self._next = self._next, self._next + 1
            self._inflight[n] = (owner, np.asarray(tokens, dtype=np.int64))
        try:
            self._queue.put_nowait((n, owner, list(tokens), list(cache), hints))
            return True
        except queue.Full:
            self._finished(n)
            self.dropped += 1
            return False

    def settle(
        self, prompt: Sequence[int] | None = None, have: int = 0, owner: str | None = None
    ) -> None:
        """Wait until every cache handed over is kept (or refused); given a lookup's
        ``prompt``, its ``owner`` (the host tier's: namespace and model) and the
        ``have`` tokens memory already gives it, only for that owner's hand-overs
        that share more of the prompt than that.  Never another owner's: the wait
        told a tenant whether another's evicted prompt began as it guessed (r15)."""
        if prompt is None:
            self._queue.join()
            return
        toks = np.asarray(prompt, dtype=np.int64)
        with self._done:
            if not self._serving(toks, have, owner):
                return
            self._settling += 1  # a copy held for a prompt phase starts now
            self._done.notify_all()
            try:
                self._done.wait_for(lambda: not self._serving(toks, have, owner))
            finally:
                self._settling -= 1

    def _serving(self, toks: np.ndarray, have: int, owner: str | None) -> bool:
        """Is a hand-over of ``owner`` in flight that serves ``toks`` far enough past
        ``have``: by ``gain`` tokens, or by half of what memory leaves to prefill when
        that is less (a short prompt's whole conversation is worth its short copy)?"""
        want = have + max(1, min(self.gain, (len(toks) - have) // 2))
        for whose, kept in self._inflight.values():
            if whose != owner or min(len(kept), len(toks)) < want:
                continue
            if np.array_equal(kept[:want], toks[:want]):
                return True
        return False

    def _hold(self) -> None:
        """Wait while a request is in its prompt phase (at most the gate's ``hold``
        seconds), unless a lookup waits for a copy in flight or another eviction
        waits behind this one: a copy beside a prefill slows both (issue 39), but a
        dropped one is a returning conversation's lost prefix.  Polled: the gate is
        another lock."""
        gate = self.gate
        if gate is None:
            return
        deadline = time.monotonic() + gate.hold
        with self._done:
            self.holding += 1
            try:
                # never while another eviction waits behind: under steady load one
                # request always prompts, and the ones behind were dropped (r14b)
                while (
                    gate.prompting
                    and not self._settling
                    and self._queue.empty()
                    and time.monotonic() < deadline
                ):
                    self._done.wait(0.005)
            finally:
                self.holding -= 1

    def _finished(self, n: int) -> None:
        with self._done:
            self._inflight.pop(n, None)
            self._done.notify_all()

    def close(self) -> None:
        self.settle()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            n, box = item[0], [item]
            del item  # _keep holds the only reference: the cache goes once copied
            try:
                self._keep(box.pop())
            finally:
                self._finished(n)
                self._queue.task_done()

    def _keep(self, item: Kept) -> None:
        _, owner, tokens, cache, hints = item
        del item
        try:
            self._hold()
            with writer_stream():
                self.host.keep(owner, tokens, cache, hints=hints)
            del cache  # its device memory goes back as soon as the copy is made
        except Exception as e:  # the tier must never take the server down
            log.warning("persist: could not keep an evicted cache in the host cache: %s", e)
            if self.on_error is not None:
                self.on_error(e)
