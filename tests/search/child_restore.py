"""Run in a fresh process: restore a named session from a store, continue it, report.

argv: job.json out.json.  The job names the model (``recipe``: a model folder,
or an mlx-lm architecture the search builds tiny), the store (folder, block
size), the session, the tokens to feed and the kv_bits settings.  The report
holds the restored tokens, the state before the first call (the layers the
oracle compares there) and, after each call, the logits and the whole state,
as hex: the parent compares them with its own fresh prefill.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

import persist
from persist.errors import SessionNotFoundError
from tests.helpers import raw
from tests.search.oracle import Quant, comparable, state_of


def model_of(recipe: dict[str, Any], cache_config: dict[str, Any]) -> tuple[Any, Any]:
    """The model a recipe names and its identity, the same in every process."""
    if "dir" in recipe:
        from mlx_lm import load

        model, tok = load(recipe["dir"])
        return model, persist.ModelIdentity.of(model, tok, **cache_config)
    from tests.search.architectures import build

    model = build(recipe["arch"])
    return model, persist.ModelIdentity.of(model, **cache_config)


def hexed(state: dict[str, tuple[str, tuple[int, ...], bytes]]) -> dict[str, list[Any]]:
    return {k: [v[0], list(v[1]), v[2].hex()] for k, v in state.items()}


def unhexed(state: dict[str, list[Any]]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {k: (v[0], tuple(v[1]), bytes.fromhex(v[2])) for k, v in state.items()}


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    quant = Quant(**job["quant"]) if job.get("quant") else None
    model, ident = model_of(job["recipe"], quant.identity() if quant else {})
    with persist.Store(job["store"], block_tokens=job["block_tokens"]) as store:
        try:
            loaded = store.restore(job["session"], identity=ident)
        except SessionNotFoundError:  # a repair removed it: the parent knows when
            Path(sys.argv[2]).write_text(json.dumps({"missing": True}))
            return
    cache = loaded.cache
    report: dict[str, Any] = {
        "tokens": loaded.tokens,
        "before": hexed(state_of(comparable(cache))),
        "steps": [],
    }
    for t in job["next"]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        if quant is not None:
            quant.convert(cache)
        mx.eval(logits)
        report["steps"].append({"logits": raw(logits).hex(), "state": hexed(state_of(cache))})
    Path(sys.argv[2]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
