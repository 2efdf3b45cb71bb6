"""The labelled byte dump of docs/FORMAT.md's example file (tests/golden/example/tiny.safetensors).

    python -m tests.golden.example.render          # print the dump
    python -m tests.golden.example.render --make   # write the file (once; it is committed)

tests/format/test_container.py checks that FORMAT.md holds exactly this dump
of the committed file, and that the file decodes.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
from pathlib import Path

import msgpack

FILE = Path(__file__).with_name("tiny.safetensors")


def make() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    import persist

    c = KVCache()
    k = mx.array([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=mx.float16)  # B=1, H=1, T=2, D=2
    c.update_and_fetch(k, -k)
    persist.save_file(FILE, [c], [7, 9], metadata={"case": "tiny"})


def hexline(data: bytes) -> str:
    return " ".join(f"{b:02x}" for b in data)


def render(raw: bytes) -> str:
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    manifest = msgpack.unpackb(base64.b64decode(meta["manifest"]), raw=False)
    out = [
        f"file: {len(raw)} bytes",
        f"0x0000  {hexline(raw[:8])}  u64 LE: header length N = {n}",
        f"0x0008  JSON header, {n} bytes (padded with spaces to 8-byte alignment):",
        "  __metadata__:",
    ]
    for key in ("format", "format_version", "manifest_xxh3"):
        out.append(f"    {key} = {meta[key]!r}")
    out.append(f"    manifest = base64 of {len(base64.b64decode(meta['manifest']))} msgpack bytes:")
    for key, value in manifest.items():
        if key == "tokens":
            ids = list(struct.unpack(f"<{len(value) // 4}I", value))
            value = f"{hexline(value)}  (uint32 LE: {ids})"
        elif key == "tensors":
            value = {k: [v[0], v[1], v[2].hex()] for k, v in value.items()}
        elif key == "created":
            value = "<Unix time of the save>"
        out.append(f"      {key}: {value}")
    for key, entry in header.items():
        out.append(
            f"  {key!r}: dtype {entry['dtype']}, shape {entry['shape']}, "
            f"data_offsets {entry['data_offsets']}"
        )
    base = 8 + n
    out.append(f"0x{base:04x}  data section ({len(raw) - base} bytes):")
    for key, entry in header.items():
        lo, hi = entry["data_offsets"]
        out.append(
            f"0x{base + lo:04x}  {hexline(raw[base + lo : base + hi])}  {key} ({entry['dtype']})"
        )
    return "\n".join(out)


if __name__ == "__main__":
    if "--make" in sys.argv:
        make()
    print(render(FILE.read_bytes()))
