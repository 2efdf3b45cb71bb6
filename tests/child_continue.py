"""Run in a fresh process: load a persist file, continue it, write the results.

argv: model_dir job.json.  The job lists (cache file, next tokens, out file);
a job with "store" and "session" restores a named session from a store instead
("shared": a shared tier's URL; "lookup": a prompt to look up instead of a session).
Each out file is a safetensors file of the step logits and the live state
after the continuation, plus the greedy tokens in its metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

import persist
from tests.helpers import continue_run, live_state


def main() -> None:
    model_dir, job_path = sys.argv[1], sys.argv[2]
    model, tok = load(model_dir)
    for job in json.loads(Path(job_path).read_text()):
        if "store" in job:  # restore a named session (or look up a prompt) from a store
            ident = persist.ModelIdentity.of(model, tok, **job.get("cache_config", {}))
            tiers = {"shared": job.get("shared"), "cold": job.get("cold")}
            with persist.Store(job["store"], **tiers) as store:
                if "lookup" in job:
                    loaded = store.lookup(job["lookup"], identity=ident)
                    assert loaded is not None, "no hit"
                else:
                    loaded = store.restore(job["session"], identity=ident)
        else:
            loaded = persist.load_file(job["file"])
        before = live_state(loaded.cache)
        logits, greedy = continue_run(model, loaded.cache, job["next"])
        after = live_state(loaded.cache)
        arrays = {f"logits.{i}": x for i, x in enumerate(logits)}
        meta = {
            "greedy": json.dumps(greedy),
            "tokens": json.dumps(loaded.tokens),
            "before": json.dumps({k: [v[0], list(v[1]), v[2].hex()] for k, v in before.items()}),
            "after": json.dumps({k: [v[0], list(v[1]), v[2].hex()] for k, v in after.items()}),
        }
        mx.save_safetensors(job["out"], arrays, metadata=meta)


if __name__ == "__main__":
    main()
