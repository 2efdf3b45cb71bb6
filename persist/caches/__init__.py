"""Caches that keep the whole cache contract persistence depends on."""

from __future__ import annotations

from .delayed import DelayedQuantizedKVCache

__all__ = ["DelayedQuantizedKVCache"]
