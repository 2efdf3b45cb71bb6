"""Does an imported cache fit this model?  A file's caches against the layout of
the model's own ``make_prompt_cache`` (layers, kinds, heads, head dims, dtypes,
windows, recurrent state shapes), and its quantized layers against the identity:
``transfer.read_importable`` checks both before anything is stored.  And does a
kv_bits identity fit the model at all (``refuse_unfit_kv_bits``)?
"""

from __future__ import annotations

import weakref
from typing import Any

from ..errors import IdentityMismatchError, InvalidArgumentError
from ..identity import ModelIdentity
from ..kinds import kind_of
from .layer_checks import (
    MLX_LM_GROUP_SIZE,
    refuse_early,
    refuse_plain_past_start,
    refuse_quantized,
    refuse_quantized_rings,
)

__all__ = ["check_fits", "check_quantized", "refuse_unfit_kv_bits"]


ATTENTION = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache")


def check_fits(cache: list[Any], model: Any, where: str, max_kv_size: int | None = None) -> None:
    """Refuse a cache another model computed: the layer count, each layer's kind
    (attention, recurrent, a list) and shapes (heads, head dims, dtypes; recurrent
    state shapes) must be those of the model's own ``make_prompt_cache`` after one
    token, so nothing is stored that the model would crash on or misread.  A
    rotating layer's window (size, keep) is part of its kind: a ring made with
    ``--max-kv-size`` is not the model's without it (``max_kv_size``)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    probe = make_prompt_cache(model, max_kv_size=max_kv_size)
    model(mx.array([[0]]), cache=probe)
    mx.eval([c.state for c in probe])
    got, want = [_layout(c) for c in cache], [_layout(c) for c in probe]
    if len(got) != len(want):
        raise IdentityMismatchError(
            where, ["layers"], _describe(got), f"a model of {_describe(want)}"
        )
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    if bad:
        i = bad[0]
        fields = [f"layer {j}" for j in bad[:4]] + (
            [f"{len(bad) - 4} more"] if len(bad) > 4 else []
        )
        raise IdentityMismatchError(
            where,
            fields,
            f"layer {i}: {_show(got[i])}",
            f"a model whose layer {i} is {_show(want[i])}",
        )


def check_quantized(cache: list[Any], identity: ModelIdentity, where: str) -> None:
    """Quantized layers (generate --kv-bits) only under an identity of the same
    kv_bits and kv_group_size, and quantized from at least its quantized_kv_start
    positions (a file records no conversion point: its offset stands for it;
    ``layer_checks``, which ``Store.save`` applies too): checked here before
    ``check_fits`` runs the model."""
    for i, c in enumerate(cache):
        for q in (x for x in getattr(c, "caches", [c]) if type(x).__name__ == "QuantizedKVCache"):
            refuse_quantized(f"layer {i}", q.bits, q.group_size, identity, where)
            floor = getattr(q, "min_resume_offset", None)
            refuse_early(f"layer {i}", int(q.offset) if floor is None else floor, identity, where)
    n = max((int(o) for c in cache if type(o := getattr(c, "offset", None)) is int), default=0)
    refuse_plain_past_start([{"kind": kind_of(c)} for c in cache], n, identity, where)


def _show(layout: tuple[Any, ...]) -> str:
    if layout[0] == "attention" and len(layout) >= 5:
        window = f", a window of {layout[5]} (keep {layout[6]})" if len(layout) > 5 else ""
        return f"attention, {layout[1]} heads of {layout[2]}/{layout[3]}, {layout[4]}{window}"
    return " ".join(str(x) for x in layout)


def _describe(layout: list[tuple[Any, ...]]) -> str:
    kinds: dict[str, int] = {}
    for lay in layout:
        kinds[lay[0]] = kinds.get(lay[0], 0) + 1
    return f"{len(layout)} layers: " + ", ".join(f"{k} x{n}" for k, n in kinds.items())


def _layout(c: Any) -> tuple[Any, ...]:
    """What must agree between a cache and the model's own, whatever its offset,
    batch size or quantization of the same heads."""
    name = type(c).__name__
    if name in ATTENTION:
        keys, values = c.keys, c.values
        if keys is None:
            return ("attention",)
        if name == "QuantizedKVCache":  # packed: head dim = columns * 32 / bits
            dims = [int(k[0].shape[-1]) * 32 // c.bits for k in (keys, values)]
            return ("attention", int(keys[0].shape[1]), *dims, _dtype(keys[1]))
        window = (int(c.max_size), int(c.keep)) if name == "RotatingKVCache" else ()
        return (
            "attention",
            int(keys.shape[1]),
            int(keys.shape[-1]),
            int(values.shape[-1]),
            _dtype(keys),
            *window,
        )
    if name == "CacheList":
        return ("list", tuple(_layout(x) for x in c.caches))
    state = getattr(c, "cache", None)
    if isinstance(state, list):  # ArraysCache, MambaCache: every state but the batch axis
        return (
            "recurrent",
            tuple(None if a is None else (_dtype(a), tuple(a.shape[1:])) for a in state),
        )
    return (name,)


def _dtype(a: Any) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def refuse_unfit_kv_bits(model: Any, identity: ModelIdentity) -> None:
    """InvalidArgumentError, before any prompt token runs, for a kv_bits identity
    mlx-lm cannot apply to ``model``'s caches: rings (``refuse_quantized_rings``), or
    bits and a group size MLX's quantize refuses for some layer (a group the head
    dims do not divide: mlx raised a bare ValueError once a prompt reached
    quantized_kv_start).  Probed as mlx-lm converts (``maybe_quantize_kv_cache``:
    each top-level layer with ``to_quantized``) on fresh caches after one token."""
    cfg = dict(identity.cache_config)
    bits = cfg.get("kv_bits")
    if bits is None:
        return
    refuse_quantized_rings(identity)
    fitted = _fitted.get(id(model))
    key = tuple(sorted(cfg.items()))
    if fitted is not None and fitted[0]() is model and key in fitted[1]:
        return  # probed already: prefill asks on every call, a forward each time
    _probe(model, identity, cfg, bits)
    if fitted is None or fitted[0]() is not model:
        fitted = _fitted[id(model)] = (weakref.ref(model), set())
    fitted[1].add(key)


# id(model) -> (the model, the cache configs that fit it): nn.Module is a dict, unhashable
_fitted: dict[int, tuple[weakref.ref[Any], set[tuple[Any, ...]]]] = {}


def _probe(model: Any, identity: ModelIdentity, cfg: dict[str, Any], bits: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    group = cfg.get("kv_group_size", MLX_LM_GROUP_SIZE)
    probe = make_prompt_cache(model, max_kv_size=cfg.get("max_kv_size"))
    model(mx.array([[0]]), cache=probe)
    for i, c in enumerate(probe):
        if not hasattr(c, "to_quantized"):
            continue
        try:
            c.to_quantized(group_size=group, bits=bits)
        except ValueError as e:  # mlx: "[quantize] The last dimension ... group size 32"
            dims = getattr(getattr(c, "keys", None), "shape", ())[-1:]
            raise InvalidArgumentError(
                f"kv_bits={bits} kv_group_size={group} (--kv-bits {bits} --kv-group-size "
                f"{group}) do not fit {identity.display()}: "
                f"layer {i}"
                + (f" (head dim {dims[0]})" if dims else "")
                + f" cannot be quantized so ({str(e).splitlines()[0]})"
            ) from None
