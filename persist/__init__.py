"""persist: save MLX inference caches to disk and resume them bit-exactly.

The public API; everything else is internal.  Names are imported on first
use (PEP 562), so ``import persist``, ``import persist.storage`` and the
store-only commands never import mlx or mlx-lm, and nothing here imports
click.  The errors are plain and imported at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BlockSizeMismatchError,
    CorruptBlobError,
    ExportTargetError,
    HostCacheFullError,
    IdentityMismatchError,
    IdentityUnavailableError,
    InvalidArgumentError,
    InvalidMetadataError,
    InvalidNameError,
    InvalidStateError,
    InvalidTokensError,
    ModelNotFoundError,
    NotResumableError,
    PersistError,
    ReadOnlyStoreError,
    SaveLostError,
    SessionConflictError,
    SessionDeletedError,
    SessionNotFoundError,
    SessionUnreachableError,
    SessionUnreadableError,
    StorageError,
    StoreBusyError,
    StoreFullError,
    StoreNotFoundError,
    UnauthenticatedFileError,
    UnknownKindError,
    UnsafeStoreError,
    UnsupportedCacheError,
    UnsupportedFormatError,
    UnsupportedVersionError,
)

__version__ = "0.1.0"

# public name -> the module that defines it (the kind registry through
# ``codecs``, whose import registers the built-in kinds)
_LAZY = {
    "kind_of": "codecs",
    "register_kind": "codecs",
    "codec_for": "codecs",
    "is_recurrent": "codecs",
    "is_rotating": "codecs",
    "is_quantized": "codecs",
    "is_batched": "codecs",
    "save_file": "engine.files",
    "load_file": "engine.files",
    "read_manifest": "engine.files",
    "Loaded": "engine.files",
    "extract_row": "codecs.snapshot",
    "Store": "engine.store",
    "EntryInfo": "storage.types",
    "Restored": "storage.types",
    "GcReport": "storage.types",
    "Problem": "storage.types",
    "StoreStats": "storage.types",
    "prefill": "engine.prefill",
    "speculative_greedy": "apps.speculative",
    "ModelIdentity": "identity",
    "Record": "records",
    "RecordSpec": "records",
    "ResumeFacts": "records",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'persist' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from .apps.speculative import speculative_greedy
    from .codecs.snapshot import extract_row
    from .engine.files import Loaded, load_file, read_manifest, save_file
    from .engine.prefill import prefill
    from .engine.store import Store
    from .identity import ModelIdentity
    from .kinds import (
        codec_for,
        is_batched,
        is_quantized,
        is_recurrent,
        is_rotating,
        kind_of,
        register_kind,
    )
    from .records import Record, RecordSpec, ResumeFacts
    from .storage.types import EntryInfo, GcReport, Problem, Restored, StoreStats

__all__ = [
    "__version__",
    "kind_of",
    "register_kind",
    "codec_for",
    "is_recurrent",
    "is_rotating",
    "is_quantized",
    "is_batched",
    "save_file",
    "load_file",
    "read_manifest",
    "Loaded",
    "extract_row",
    "Store",
    "EntryInfo",
    "Restored",
    "GcReport",
    "Problem",
    "StoreStats",
    "prefill",
    "speculative_greedy",
    "ModelIdentity",
    "Record",
    "RecordSpec",
    "ResumeFacts",
    "PersistError",
    "UnknownKindError",
    "UnsupportedVersionError",
    "IdentityMismatchError",
    "IdentityUnavailableError",
    "CorruptBlobError",
    "NotResumableError",
    "SessionNotFoundError",
    "SessionDeletedError",
    "StoreFullError",
    "InvalidNameError",
    "InvalidTokensError",
    "UnsupportedCacheError",
    "UnsupportedFormatError",
    "InvalidArgumentError",
    "InvalidMetadataError",
    "InvalidStateError",
    "BlockSizeMismatchError",
    "StoreBusyError",
    "SaveLostError",
    "UnsafeStoreError",
    "ExportTargetError",
    "UnauthenticatedFileError",
    "ReadOnlyStoreError",
    "SessionConflictError",
    "StorageError",
    "AlreadyExistsError",
    "ModelNotFoundError",
    "AccessDeniedError",
    "HostCacheFullError",
    "SessionUnreachableError",
    "SessionUnreadableError",
    "StoreNotFoundError",
]
