"""Why a prompt missed, or hit shorter than what the store shares with it.

``Store.explain`` reads the index only (no blob is read, nothing is counted or
touched): every snapshot of the namespace that shares a prefix with the prompt,
where the prompt diverges from each, and the reason the best usable hit is
shorter than the longest shared prefix.  ``bounded`` reads only the rows the
lookup keys lead to (``storage.nearest``: a few index seeks and a few dozen
rows, whatever the namespace holds), as ``persist serve`` does on every miss;
either way the row a lookup would restore is found by the lookup's own query.
Other namespaces are never read for content: at most their count of longer
shared prefixes is reported, and only when the caller asks (an operator; never
a tenant of ``persist serve``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import policy
from ..format.tokens import common_prefix_packed, pack_tokens, unpack_tokens
from ..identity import ModelIdentity
from ..servable import of_row, plain_reason
from ..storage.blobs import BlobStore
from ..storage.chains import HEAD_TOKENS
from ..storage.index import Index
from ..storage.nearest import near_rows
from ..storage.rows import SnapshotRow, listed_info
from .costs import CostModel, local_hit
from .layer_checks import quantized_start
from .reading import _other_backend as computed_elsewhere
from .reading import index_hit, saved_identity
from .unverified import marked

__all__ = ["Near", "Explanation", "explain", "REASONS"]

# Every reason ``explain`` gives, by code: the code is stable (metrics label it),
# the message is for people.
REASONS = {
    "hit": "the best usable hit covers the whole shared prefix",
    # a chat template's first tokens are shared by every prompt: too few to reuse
    "empty": f"nothing stored in this namespace shares {HEAD_TOKENS} tokens with the prompt",
    "identity": "the longest shared prefix was computed by another model identity",
    "last-token": "one prompt token must be left to compute, so a hit stops one short",
    "floor": "the snapshot serves no prefix below its resume floor",
    "exact-only": "the snapshot serves only its own length (its state cannot be cut back)",
    "unverified": "the snapshot's tokens are the caller's word (imported unverified)",
    "damaged": "the snapshot's index row fails its checksum, or its blobs failed their checks",
    "declined": "the cost model predicts prefilling the prefix is faster than restoring it",
    "backend": "the snapshot was computed on another backend (a strict store)",
    "kv-bits-plain": (
        "the snapshot holds layers plain past quantized_kv_start, where mlx-lm under "
        "this identity's kv_bits holds them quantized (an older persist saved it)"
    ),
}
CONTEXT = 4  # tokens shown on each side of a divergence


@dataclass(frozen=True, kw_only=True)
class Near:
    """One stored snapshot sharing ``shared`` tokens with the prompt."""

    id: int
    session: str | None
    role: str
    tokens: int  # the snapshot's length
    shared: int  # longest common prefix with the prompt
    usable: int  # what a lookup may restore from it (0: nothing)
    reason: str  # a REASONS code: why usable < shared ("hit" when equal)
    detail: str  # the facts behind the reason, for people
    identity_fields: list[str] = field(default_factory=list)  # differing fields, by name
    prompt_next: list[int] = field(default_factory=list)  # the prompt's tokens at divergence
    stored_next: list[int] = field(default_factory=list)  # the snapshot's tokens there
    before: list[int] = field(default_factory=list)  # shared tokens just before it
    text: dict[str, str] = field(default_factory=dict)  # the above decoded, with a tokenizer
    in_markup: bool = False  # the divergence is at a special (chat template) token


@dataclass(frozen=True, kw_only=True)
class Explanation:
    prompt_tokens: int
    namespace: str
    best: Near | None  # the best usable hit for this identity (None: a miss)
    longest: Near | None  # the snapshot sharing the most tokens, any identity
    reason: str  # why best.usable < longest.shared (a REASONS code)
    message: str
    nearest: list[Near]
    other_namespaces: int | None = None  # snapshots elsewhere sharing more (when asked)
    cost: dict[str, Any] | None = None  # the cost model's prediction for the best hit

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _why_short(
    row: SnapshotRow, shared: int, usable: int, prompt_len: int, kinds: list[str], start: int | None
) -> tuple[str, str]:
    """(reason, detail) for a same-identity snapshot whose usable prefix is below ``shared``
    (``start``: the identity's quantized_kv_start under kv_bits)."""
    p = min(shared, prompt_len - 1, row.n_tokens)
    if usable == p < shared:  # it serves all it may: only the prompt's end stops it
        return "last-token", f"the prompt is {prompt_len} tokens; a hit keeps the last to compute"
    rule = of_row(row.trimmable, row.min_resume, row.manifest, start)
    if start is not None and rule.below is not None and p >= rule.below:
        why = plain_reason(row.manifest, start)
        return "kv-bits-plain", f"{why}; this identity quantizes from quantized_kv_start {start}"
    if p < max(row.min_resume, rule.floor):
        what = ", ".join(sorted({k for k in kinds if k != "kv"})) or "its layers"
        return "floor", f"no prefix below {max(row.min_resume, rule.floor)} tokens ({what})"
    if not row.trimmable or not rule.trimmable:
        what = ", ".join(sorted({k for k in kinds if k not in ("kv", "concat-kv")})) or "state"
        return "exact-only", f"only at exactly {row.n_tokens} tokens ({what} cannot be cut)"
    return "hit", ""


def _near(
    row: SnapshotRow,
    toks: list[int],
    packed: bytes,
    *,
    identity: ModelIdentity,
    decode: Callable[[list[int]], str] | None,
    special: set[int],
) -> Near:
    shared = common_prefix_packed(row.tokens, packed)
    stored = unpack_tokens(row.tokens[4 * max(0, shared - CONTEXT) : 4 * (shared + CONTEXT)])
    at = min(shared, CONTEXT)  # where the divergence falls in ``stored``'s window
    info = listed_info(row)
    fields: list[str] = []
    if row.identity != identity.digest:
        fields = identity.diff(saved_identity(row)) or ["digest"]
        reason, detail, usable = "identity", "differs in " + ", ".join(fields), 0
    else:
        n = len(toks)
        start = quantized_start(identity)
        usable = policy.usable_prefix(row.n_tokens, shared, n, row.trimmable, row.min_resume)
        # the lookup's own last word: the row's layers' rules (persist.servable)
        rule = of_row(row.trimmable, row.min_resume, row.manifest, start)
        if usable and not rule.serves(usable, row.n_tokens):
            usable = 0
        reason, detail = ("hit", "")
        if usable < shared:
            reason, detail = _why_short(row, shared, usable, n, info.kinds, start)
        if marked(row.metadata):
            detail = (detail + "; " if detail else "") + REASONS["unverified"]
    p_next, s_next = toks[shared : shared + CONTEXT], stored[at : at + CONTEXT]
    before = toks[max(0, shared - CONTEXT) : shared]
    text = {}
    if decode is not None:
        text = {"before": decode(before), "prompt_next": decode(p_next)}
        text["stored_next"] = decode(s_next)
    markup = bool(special) and any(t in special for t in p_next[:1] + s_next[:1])
    return Near(
        id=row.id,
        session=row.name,
        role=row.role,
        tokens=row.n_tokens,
        shared=shared,
        usable=usable,
        reason=reason,
        detail=detail,
        identity_fields=fields,
        prompt_next=p_next,
        stored_next=s_next,
        before=before,
        text=text,
        in_markup=markup,
    )


def explain(
    index: Index,
    blobs: BlobStore,
    costs: CostModel,
    tokens: Sequence[int],
    *,
    identity: ModelIdentity,
    namespace: str,
    limit: int = 5,
    tokenizer: Any = None,
    other_namespaces: bool = False,
    strict_backend: bool = False,
    block: int,
    bounded: bool = False,
) -> Explanation:
    """``bounded``: read only the rows near the prompt (``storage.nearest``, the
    store's ``block`` size), else every row of the namespace.  Either way the row a
    lookup would restore is read too, found by the lookup's own index query, so the
    best hit is the lookup's however many rows share the prefix."""
    toks, packed = list(tokens), pack_tokens(tokens)
    decode = None if tokenizer is None else (lambda ids: str(tokenizer.decode(ids)))
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    if bounded:
        listed = near_rows(index, namespace, identity.digest, toks, block)
    else:
        listed = index.snapshots(namespace, named_only=False)
    rows = {r.id: r for r in listed}
    for r in lookup_choices(index, toks, identity, namespace, block, strict_backend):
        rows.setdefault(r.id, r)
    nears = [
        n
        for n in (
            _near(r, toks, packed, identity=identity, decode=decode, special=special)
            for r in rows.values()
        )
        if n.shared >= HEAD_TOKENS  # a lookup never reuses less (storage.chains)
    ]
    with index.read() as db:  # the checksums of the rows that share a prefix, no others
        nears = [_judged(n, rows[n.id], db, identity, strict_backend) for n in nears]
    nears.sort(key=lambda n: (-n.usable, -n.shared, n.id))
    best = next((n for n in nears if n.usable), None)
    longest = max(nears, key=lambda n: (n.shared, n.usable), default=None)
    cost = None
    if best is not None:
        cost, best = _priced(index, blobs, costs, identity=identity, best=best, row=rows[best.id])
    reason, message = _verdict(best, longest)
    others = _elsewhere(index, namespace, toks, longest) if other_namespaces else None
    shown = sorted(nears, key=lambda n: (-n.shared, -n.usable, n.id))[:limit]
    return Explanation(
        prompt_tokens=len(toks),
        namespace=namespace,
        best=best,
        longest=longest,
        reason=reason,
        message=message,
        nearest=shown,
        other_namespaces=others,
        cost=cost,
    )


LOOKUP_TRIES = 4  # rows a lookup's choice may pass over (damaged, another backend)


def lookup_choices(
    index: Index,
    toks: list[int],
    identity: ModelIdentity,
    namespace: str,
    block: int,
    strict: bool,
) -> list[SnapshotRow]:
    """The rows ``Store.lookup`` would try, in its order (``reading.index_hit``: a few
    index seeks and a bounded number of rows, however many share the prefix): the
    first it would restore, after those it would pass over (at most LOOKUP_TRIES)."""
    out: list[SnapshotRow] = []
    skip: set[int] = set()
    while len(out) < LOOKUP_TRIES:
        found = index_hit(index, toks, identity, namespace=namespace, block_tokens=block, skip=skip)
        if found is None:
            break
        row = found[0]
        out.append(row)
        with index.read() as db:
            passed = bool(Index.damaged_rows(db, row.id))
        if not passed and not (strict and computed_elsewhere(row, identity)):
            break
        skip.add(row.id)
    return out


def _replace(n: Near, **kw: Any) -> Near:
    return Near(**{**asdict(n), **kw})


def _judged(n: Near, row: SnapshotRow, db: Any, identity: ModelIdentity, strict: bool) -> Near:
    """``n`` as a lookup would take it: a row failing its checksum is skipped, and a
    strict store skips one computed on another backend."""
    if Index.damaged_rows(db, row.id):
        return _replace(n, usable=0, reason="damaged", detail=REASONS["damaged"])
    if strict and n.usable and computed_elsewhere(row, identity):
        return _replace(n, usable=0, reason="backend", detail=REASONS["backend"])
    return n


def _priced(
    index: Index,
    blobs: BlobStore,
    costs: CostModel,
    *,
    identity: ModelIdentity,
    best: Near,
    row: SnapshotRow,
) -> tuple[dict[str, Any], Near]:
    """The cost model's verdict on ``best`` (``CostModel.predict``: recorded nowhere, and
    without the exploration a lookup sometimes makes of a declined hit)."""
    tier, nbytes = local_hit(index, blobs, row, best.usable)
    d = costs.predict(identity, [(tier, nbytes)], best.usable, costs.max_cost)
    if d.restore:
        return asdict(d), best
    detail = (
        f"restore {d.restore_s or 0:.3f} s predicted against "
        f"{'a limit of' if d.reason == 'max_cost' else 'a prefill of'} "
        f"{(costs.max_cost if d.reason == 'max_cost' else d.prefill_s) or 0:.3f} s "
        f"({d.reason}; a lookup may still restore it now and then, to measure again)"
    )
    return asdict(d), _replace(best, reason="declined", detail=detail)


def _verdict(best: Near | None, longest: Near | None) -> tuple[str, str]:
    if longest is None:
        return "empty", REASONS["empty"]
    if best is not None and best.reason == "declined":
        return "declined", f"{REASONS['declined']}: {best.detail}"
    got = best.usable if best is not None else 0
    if got >= longest.shared:
        return "hit", f"{REASONS['hit']} ({got} tokens)"
    why = longest.reason if longest.reason != "hit" else "last-token"
    detail = f": {longest.detail}" if longest.detail else ""
    return why, (
        f"{longest.shared} tokens shared with snapshot {longest.id}, {got} usable; "
        f"{REASONS[why]}{detail}"
    )


def _elsewhere(index: Index, namespace: str, toks: list[int], longest: Near | None) -> int:
    """How many snapshots of other namespaces share more than ``longest`` (a count only)."""
    floor, packed = (longest.shared if longest is not None else 0), pack_tokens(toks)
    n = 0
    for r in index.snapshots(None, named_only=False):
        if r.namespace != namespace and common_prefix_packed(r.tokens, packed) > floor:
            n += 1
    return n
