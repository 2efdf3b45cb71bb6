"""What a model identity costs: hashing every weight, against the remembered digest.

    python -m bench.bench_identity

A random-weight llama of about 1 GiB (bf16) on disk; ``ModelIdentity.from_path``
with an empty digest memo (every weight hashed) and with the memo the first
call wrote (a lookup by file facts), minimum of interleaved runs.
Results in bench/results/identity.json and .md.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import persist
from bench.common import RESULTS, machine
from persist.apps.demo import make_model

SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "intermediate_size": 8192,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
REPS = 3


def main() -> None:
    tmp = Path(tempfile.mkdtemp(dir=Path(__file__).parent))
    try:
        model = make_model(tmp / "model", "llama", overrides=SHAPE)
        size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        memo = tmp / "memo"
        os.environ["PERSIST_IDENTITY_CACHE"] = str(memo)
        cold, warm = float("inf"), float("inf")
        for _ in range(REPS):
            shutil.rmtree(memo, ignore_errors=True)
            t = time.perf_counter()
            first = persist.ModelIdentity.from_path(model)
            cold = min(cold, time.perf_counter() - t)
            t = time.perf_counter()
            again = persist.ModelIdentity.from_path(model)
            warm = min(warm, time.perf_counter() - t)
            assert first == again
        r = {"machine": machine(), "weight_bytes": size, "hashed_s": cold, "remembered_s": warm}
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "identity.json").write_text(json.dumps(r, indent=2) + "\n")
        md = (
            "# Model identity\n\n"
            f"`ModelIdentity.from_path` on a {size / 2**30:.2f} GiB random-weight llama: "
            f"{cold:.3f} s with every weight hashed, {warm:.3f} s with the remembered digest "
            f"({cold / warm:.0f}x), the same identity. Minimum of {REPS} interleaved runs.\n"
        )
        (RESULTS / "identity.md").write_text(md)
        print(md)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
