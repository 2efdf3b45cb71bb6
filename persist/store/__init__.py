"""The store's storage layer: SQLite index, blob files, checks.  Never imports mlx."""

from __future__ import annotations

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
