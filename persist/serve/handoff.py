"""Handing a cache from mlx-lm's generation thread to persist's writer thread.

The generation thread only evaluates the cache's arrays on its own stream (most
are evaluated already: a decode step's cache update is part of its logits; a
batch's extracted row is a lazy slice, computed where it was made).  The copy
to host bytes (``codecs.snapshot.capture``: on CUDA a device copy and a
device-to-host read, about 0.37 s per GiB on an H200) runs on the writer
thread, on a stream of its own, so it never delays the next request.  This is
safe because an evaluated MLX array never changes, and mlx-lm never changes a
cache it stored: it hands out deep copies (``LRUPromptCache.fetch_nearest_cache``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

__all__ = ["handed_off", "writer_stream"]

_local = threading.local()


def handed_off(cache: Any) -> None:
    """Evaluate every layer's state on the calling thread (its stream)."""
    mx.eval([layer.state for layer in cache])


@contextlib.contextmanager
def writer_stream() -> Iterator[None]:
    """Run MLX ops on this thread's own stream (made once per thread): the
    writer's copies queue behind none of the generation thread's work."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = mx.new_thread_local_stream(mx.default_device())
    with mx.stream(stream):
        yield
