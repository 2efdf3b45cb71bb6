"""Caches that keep the whole cache contract persistence depends on."""

from __future__ import annotations

from .delayed import DelayedQuantizedKVCache
from .gated_delta import GatedDeltaCache, make_cache

__all__ = ["DelayedQuantizedKVCache", "GatedDeltaCache", "make_cache"]
