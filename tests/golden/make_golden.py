"""Write the golden files of the current format version into tests/golden/v<N>/.

Commit the output.  Existing golden files are never rewritten: a run only
adds the cases (new kinds) that have no file yet, so every file ever written
stays as it was (tests/format/test_golden.py checks every version):

    python -m tests.golden.make_golden
"""

from __future__ import annotations

import json
from pathlib import Path

import persist
from persist.format.manifest import FORMAT_VERSION
from tests.golden.cases import CASES, IDENTITY, probe


def main() -> None:
    out = Path(__file__).parent / f"v{FORMAT_VERSION}"
    out.mkdir(parents=True, exist_ok=True)
    known = out / "expected.json"
    expected = json.loads(known.read_text()) if known.exists() else {}
    for name, build in CASES.items():
        if (out / f"{name}.safetensors").exists():
            continue
        cache = build()
        rows = getattr(getattr(cache, "offset", None), "shape", None)
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
    print(f"{len(expected)} golden files in {out}")


def _offset(cache: object) -> int:
    facts = persist.codecs.snapshot.snapshot_facts([cache])[0]
    return facts.offset or 0


if __name__ == "__main__":
    main()
