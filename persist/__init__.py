"""persist: save MLX inference caches to disk and resume them bit-exactly.

The public API; everything else is internal.  Importing persist imports mlx
and mlx-lm (the codecs are registered on first use), never click.
"""

from __future__ import annotations

from .errors import (
    CorruptBlobError,
    IdentityMismatchError,
    InvalidNameError,
    NotResumableError,
    PersistError,
    SessionNotFoundError,
    StoreFullError,
    UnknownKindError,
    UnsupportedVersionError,
)
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
from .prefill import prefill
from .records import Record, RecordSpec, ResumeFacts
from .sessions import Store
from .snapshot import extract_row
from .speculative import speculative_greedy
from .store.types import EntryInfo, GcReport, Problem, Restored, StoreStats

__version__ = "0.1.0"

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
    "CorruptBlobError",
    "NotResumableError",
    "SessionNotFoundError",
    "StoreFullError",
    "InvalidNameError",
]
