"""Shared pieces of the codecs: dtype names, validation helpers, buffers.

Every ``check`` raises ``CorruptBlobError`` naming the kind and the field, so
a hostile or damaged record is refused before anything is allocated.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..errors import CorruptBlobError
from ..format.tensors import MX_TO_NAME, NAME_TO_MX, dtype_name
from ..records import FLOAT_DTYPES, INT_DTYPES, RecordSpec, TensorSpec

__all__ = [
    "MX_TO_NAME",
    "NAME_TO_MX",
    "dtype_name",
    "invalid",
    "meta_int",
    "meta_bool",
    "meta_opt_int",
    "expect_tensor_names",
    "expect_tensor",
    "with_capacity",
    "round_up",
    "blank",
    "LeafCodec",
    "step_capacity",
    "room",
    "live",
    "MAX_DIM",
    "cut",
]

# Bounds on integers read from files: generous for real models, small enough
# that arithmetic on them cannot be used to request absurd allocations.
MAX_DIM = 1 << 31


def invalid(spec: RecordSpec, detail: str) -> CorruptBlobError:
    return CorruptBlobError(f"record {spec.kind!r}", detail)


def meta_int(spec: RecordSpec, key: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    v = spec.meta.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise invalid(spec, f"meta {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def meta_opt_int(spec: RecordSpec, key: str, lo: int = 0, hi: int = MAX_DIM) -> int | None:
    if spec.meta.get(key) is None:
        return None
    return meta_int(spec, key, lo, hi)


def meta_bool(spec: RecordSpec, key: str) -> bool:
    v = spec.meta.get(key)
    if type(v) is not bool:
        raise invalid(spec, f"meta {key!r} must be a boolean, got {v!r}")
    return v


def expect_tensor_names(spec: RecordSpec, names: set[str] | frozenset[str]) -> None:
    if set(spec.tensors) != set(names):
        raise invalid(spec, f"tensors {sorted(spec.tensors)} do not match expected {sorted(names)}")


def expect_tensor(
    spec: RecordSpec, name: str, ndim: int, dtypes: frozenset[str] = FLOAT_DTYPES
) -> TensorSpec:
    t = spec.tensors.get(name)
    if t is None:
        raise invalid(spec, f"missing tensor {name!r}")
    if t.dtype not in dtypes:
        raise invalid(spec, f"tensor {name!r} has dtype {t.dtype}, expected {sorted(dtypes)}")
    if len(t.shape) != ndim:
        raise invalid(spec, f"tensor {name!r} has shape {t.shape}, expected {ndim} dims")
    return t


INT_VECTOR = INT_DTYPES


class LeafCodec:
    """What every codec of a cache that holds no inner caches shares."""

    version = 1
    wrapper = False
    capabilities: frozenset[str] = frozenset()

    def children(self, cache: Any) -> list[Any]:
        return []


def step_capacity(spec: RecordSpec, cls: type[Any], n: int) -> dict[str, int]:
    """Every tensor of ``spec`` gets the room of ``n`` positions (``room``)."""
    return dict.fromkeys(spec.tensors, room(n, cls)) if n else {}


def room(n: int, cls: type[Any]) -> int:
    """Capacity for ``n`` restored positions: the class's step (256) rounded up past
    ``n``, so the first decode step after a restore writes in place instead of
    copying the whole cache to grow it (a live cache pays that growth once per step)."""
    return round_up(n + 1, getattr(cls, "step", 256))


def blank(cls: type[Any]) -> Any:
    """An instance made without ``__init__``: decode sets every field itself."""
    return object.__new__(cls)


def round_up(n: int, step: int) -> int:
    return max(step, (n + step - 1) // step * step)


def live(a: mx.array, n: int, axis: int = 2) -> mx.array:
    """The first ``n`` positions of ``a`` along ``axis`` (a lazy slice)."""
    if a.shape[axis] == n:
        return a
    idx: list[Any] = [slice(None)] * a.ndim
    idx[axis] = slice(0, n)
    return a[tuple(idx)]


def with_capacity(a: mx.array, capacity: int, axis: int = 2) -> mx.array:
    """``a`` followed by zeros up to ``capacity`` along ``axis``.

    Restored buffers get the step-rounded capacity a live cache would have,
    so the first decode step after a restore does not copy the whole cache.
    """
    n = a.shape[axis]
    if capacity <= n:
        return a
    shape = list(a.shape)
    shape[axis] = capacity - n
    return mx.concatenate([a, mx.zeros(shape, dtype=a.dtype)], axis=axis)


def cut(tensors: dict[str, Any], n: int, axis: int = 2) -> dict[str, Any]:
    """Every tensor cut to its first ``n`` positions; none at all when ``n`` is 0.

    A trimmed record holds exactly what a fresh prefill of the kept tokens
    would hold: positions past ``n`` are gone, not merely hidden by an offset.
    """
    if n == 0:
        return {}
    return {k: live(v, n, axis) for k, v in tensors.items()}
