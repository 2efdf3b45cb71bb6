"""The container alone: the streaming writer, the validating header reader, the
one atomic write path, and FORMAT.md's byte-by-byte example."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import persist
from persist.errors import CorruptBlobError
from persist.format.container import checksum, read_header, write_tensors
from persist.format.sink import atomic_write
from persist.records import TensorSpec
from tests.golden.example.render import FILE as TINY
from tests.golden.example.render import render
from tests.helpers import ROOT


def _write(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str]) -> dict[str, bytes]:
    items = [
        (k, TensorSpec("F32", a.shape), (lambda a=a: memoryview(a).cast("B")))
        for k, a in tensors.items()
    ]
    _, sums = atomic_write(
        path.with_suffix(".tmp"), path, lambda s: write_tensors(s, items, lambda _: meta)
    )
    return sums


def test_written_tensors_read_back_with_their_checksums(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones((2,), dtype=np.float32)
    sums = _write(tmp_path / "t.safetensors", {"0/a": a, "0/b": b}, {"k": "v"})
    with open(tmp_path / "t.safetensors", "rb") as f:
        h = read_header(f, "t")
        raw = f.read()
    assert list(h.tensors) == ["0/a", "0/b"]  # the order written
    assert h.metadata == {"k": "v"}
    start = h.tensors["0/a"].start - (h.file_size - len(raw))
    assert raw[start : start + a.nbytes] == a.tobytes()
    assert sums["0/a"] == checksum(a.tobytes()) and sums["0/b"] == checksum(b.tobytes())
    assert mx.load(str(tmp_path / "t.safetensors"))["0/a"].tolist() == a.tolist()


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "x.safetensors"

    def broken(sink: object) -> None:
        sink.write(b"partial")  # type: ignore[attr-defined]
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "x.tmp", final, broken)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "mangle, detail",
    [
        (lambda raw: struct.pack("<Q", 1 << 50) + raw[8:], "header"),
        (lambda raw: raw[:-3], "bytes"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "header"),
    ],
)
def test_malformed_headers_are_refused(tmp_path: Path, mangle: object, detail: str) -> None:
    p = tmp_path / "t.safetensors"
    _write(p, {"0/a": np.zeros(4, dtype=np.float32)}, {})
    p.write_bytes(mangle(p.read_bytes()))  # type: ignore[operator]
    with open(p, "rb") as f, pytest.raises(CorruptBlobError):
        read_header(f, "t")


def test_format_md_holds_the_dump_of_the_example_file() -> None:
    doc = (ROOT / "docs" / "FORMAT.md").read_text()
    assert render(TINY.read_bytes()) in doc


def test_the_example_file_decodes_to_its_cache() -> None:
    loaded = persist.load_file(TINY)
    assert loaded.tokens == [7, 9] and loaded.metadata == {"case": "tiny"}
    (c,) = loaded.cache
    keys, values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    assert keys.dtype == mx.float16 and keys.tolist() == [[[[1.0, 2.0], [3.0, 4.0]]]]
    assert values.tolist() == [[[[-1.0, -2.0], [-3.0, -4.0]]]]
    n = struct.unpack("<Q", TINY.read_bytes()[:8])[0]
    header = json.loads(TINY.read_bytes()[8 : 8 + n])
    assert (8 + n) % 8 == 0 and list(header)[1:] == ["0/keys", "0/values"]
