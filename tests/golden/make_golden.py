"""Write the golden files of the current format version into tests/golden/v<N>/.

Run once per format version and commit the output; never regenerate an
existing version (tests/test_golden.py checks every version ever written):

    python -m tests.golden.make_golden
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import persist
from persist.manifest import FORMAT_VERSION
from tests.golden.cases import CASES, IDENTITY, probe


def main() -> None:
    out = Path(__file__).parent / f"v{FORMAT_VERSION}"
    if out.exists() and "--force" not in sys.argv:
        sys.exit(f"{out} exists; golden files of a released version never change")
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name, build in CASES.items():
        cache = build()
        rows = getattr(cache.offset, "shape", None) if hasattr(cache, "offset") else None
        tokens = None if rows else list(range(_offset(cache)))
        persist.save_file(
            out / f"{name}.safetensors", [cache], tokens, metadata={"case": name}, identity=IDENTITY
        )
        expected[name] = {
            "kind": persist.kind_of(cache),
            "tokens": tokens is not None,
            "probe": probe(build()),
        }
    (out / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(expected)} golden files to {out}")


def _offset(cache: object) -> int:
    facts = persist.snapshot.snapshot_facts([cache])[0]
    return facts.offset or 0


if __name__ == "__main__":
    main()
