"""Per-kind codecs for every mlx-lm cache class, registered on import.

The kind registry (``persist.kinds``) imports nothing of this package: the
built-in kinds are registered here, so code that encodes or decodes caches
imports ``persist.codecs`` (which re-exports the registry's look-ups).
"""

from __future__ import annotations

from mlx_lm.models import cache as _c

from ..caches.delayed import DelayedQuantizedKVCache
from ..caches.gated_delta import GatedDeltaCache
from ..kinds import (
    Codec,
    class_for,
    codec_for,
    is_batched,
    is_quantized,
    is_recurrent,
    is_rotating,
    kind_of,
    register_kind,
    register_lazy_kind,
    registered_kinds,
)
from .arrays import ArraysCodec
from .batch import BatchKVCodec, BatchRotatingKVCodec
from .cachelist import CacheListCodec
from .deepseek import CLASS_PATH as DEEPSEEK_V4
from .deepseek import DeepSeekV4LayerCodec
from .delayed import DelayedQuantizedCodec
from .dispatch import capacity_of, check_spec, decode_record, encode_cache, facts_of, trim_record
from .gated_delta import GatedDeltaCodec
from .kv import ChunkedKVCodec, ConcatKVCodec, KVCodec
from .quantized import QuantizedKVCodec
from .rotating import RotatingKVCodec

__all__ = [
    "encode_cache",
    "check_spec",
    "decode_record",
    "facts_of",
    "trim_record",
    "capacity_of",
    "BUILTIN_KINDS",
    "class_for",
    "codec_for",
    "is_batched",
    "is_quantized",
    "is_recurrent",
    "is_rotating",
    "kind_of",
    "register_kind",
    "registered_kinds",
]

BUILTIN_KINDS: dict[str, tuple[type, Codec]] = {
    "kv": (_c.KVCache, KVCodec()),
    "concat-kv": (_c.ConcatenateKVCache, ConcatKVCodec()),
    "rotating-kv": (_c.RotatingKVCache, RotatingKVCodec()),
    "quantized-kv": (_c.QuantizedKVCache, QuantizedKVCodec()),
    "chunked-kv": (_c.ChunkedKVCache, ChunkedKVCodec()),
    "arrays": (_c.ArraysCache, ArraysCodec()),
    "cache-list": (_c.CacheList, CacheListCodec()),
    "batch-kv": (_c.BatchKVCache, BatchKVCodec()),
    "batch-rotating-kv": (_c.BatchRotatingKVCache, BatchRotatingKVCodec()),
    "delayed-quantized": (DelayedQuantizedKVCache, DelayedQuantizedCodec()),
    "gated-delta": (GatedDeltaCache, GatedDeltaCodec()),
}

for _name, (_cls, _codec) in BUILTIN_KINDS.items():
    register_kind(_cls, _name, _codec)

# Model-file classes: registered when their module is in use, so importing
# persist never imports a model.
register_lazy_kind("deepseek-v4-layer", *DEEPSEEK_V4, DeepSeekV4LayerCodec())
