"""persist: save MLX inference caches to disk and resume them bit-exactly.

The public API; everything else is internal.  Names are imported on first
use (PEP 562), so ``import persist``, ``import persist.store`` and the
store-only commands never import mlx or mlx-lm, and nothing here imports
click.  The errors are plain and imported at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CorruptBlobError,
    IdentityMismatchError,
    IdentityUnavailableError,
    InvalidNameError,
    InvalidTokensError,
    NotResumableError,
    PersistError,
    SessionNotFoundError,
    StoreFullError,
    UnknownKindError,
    UnsupportedVersionError,
)

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "kind_of": "kinds",
    "register_kind": "kinds",
    "codec_for": "kinds",
    "is_recurrent": "kinds",
    "is_rotating": "kinds",
    "is_quantized": "kinds",
    "is_batched": "kinds",
    "save_file": "files",
    "load_file": "files",
    "read_manifest": "files",
    "Loaded": "files",
    "extract_row": "snapshot",
    "Store": "sessions",
    "EntryInfo": "store.types",
    "Restored": "store.types",
    "GcReport": "store.types",
    "Problem": "store.types",
    "StoreStats": "store.types",
    "prefill": "chunked_prefill",  # not "prefill": a submodule of that name would shadow it
    "speculative_greedy": "speculative",
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
    from .chunked_prefill import prefill
    from .files import Loaded, load_file, read_manifest, save_file
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
    from .sessions import Store
    from .snapshot import extract_row
    from .speculative import speculative_greedy
    from .store.types import EntryInfo, GcReport, Problem, Restored, StoreStats

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
    "StoreFullError",
    "InvalidNameError",
    "InvalidTokensError",
]
