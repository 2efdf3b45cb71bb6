"""The store's storage layer: SQLite index, blob files, checks.  Never imports mlx.

Names are imported on first use (PEP 562): ``persist ls`` imports the index and
the listing, not the blob files and the container format behind them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module of this package that defines it
_LAZY = {
    "BlobStore": "blobs",
    "FileBlobs": "blobs",
    "Index": "index",
    "SCHEMA_VERSION": "schema",
    "connect": "schema",
    "EntryInfo": "types",
    "GcReport": "types",
    "Problem": "types",
    "Restored": "types",
    "StoreStats": "types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'persist.storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from .blobs import BlobStore, FileBlobs
    from .index import Index
    from .schema import SCHEMA_VERSION, connect
    from .types import EntryInfo, GcReport, Problem, Restored, StoreStats

__all__ = [
    "BlobStore",
    "FileBlobs",
    "Index",
    "SCHEMA_VERSION",
    "connect",
    "EntryInfo",
    "GcReport",
    "Problem",
    "Restored",
    "StoreStats",
]
