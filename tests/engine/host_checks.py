"""What the host-RAM tier's tests share: a model and its identity, the durable
store's own answer to compare a host hit with, and scribbling over a cache's
arrays in place to show a kept copy is no alias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import persist
from tests.helpers import NEXT, continue_run, raw

GIB = 1 << 30


def ident(tiny: Any, variant: str, **cfg: Any) -> tuple[Any, persist.ModelIdentity]:
    model, tok, _ = tiny(variant)
    return model, persist.ModelIdentity.of(model, tok, **cfg)


def scribble(a: mx.array) -> None:
    """Zero ``a``'s bytes through a numpy view of its buffer, under MLX's feet."""
    v = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    mx.eval(v)
    np.asarray(memoryview(v))[...] = 0


def durable(root: Path, prompt: list[int], identity: persist.ModelIdentity) -> Any:
    with persist.Store(root) as s:  # no host tier: the files answer
        got = s.lookup(prompt, identity=identity)
        assert got is None or got.source == "local"
        return got


def scribble_all(cache: list[Any]) -> None:
    """Zero every array of every layer's state (nested lists too), in place."""
    stack = [c.state for c in cache]
    while stack:
        x = stack.pop()
        if isinstance(x, mx.array) and x.size:
            scribble(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def same_continuation(model: Any, got: list[Any], want: list[Any]) -> None:
    a_logits, a = continue_run(model, got, NEXT, n_greedy=3)
    b_logits, b = continue_run(model, want, NEXT, n_greedy=3)
    assert a == b
    assert all(raw(x) == raw(y) for x, y in zip(a_logits, b_logits, strict=True))
