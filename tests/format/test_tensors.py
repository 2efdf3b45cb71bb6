"""Tensor I/O alone: dtype names, host bytes, capacity-sized buffers, verified piece reads."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

from persist.errors import CorruptBlobError, UnsupportedCacheError
from persist.format import tensors as tensors_module
from persist.format.container import checksum
from persist.format.tensors import (
    BATCH_BYTES,
    IOV_MAX,
    MX_TO_NAME,
    NAME_TO_MX,
    Piece,
    allocate,
    as_bytes,
    dtype_name,
    read_piece,
    read_pieces,
)
from persist.records import DTYPE_SIZES, TensorSpec


def test_every_storable_dtype_has_one_name_and_size() -> None:
    for dt, name in MX_TO_NAME.items():
        assert NAME_TO_MX[name] == dt and DTYPE_SIZES[name] == dt.size
        assert dtype_name(mx.zeros((1,), dtype=dt)) == name


def test_a_dtype_the_format_lacks_is_an_unsupported_cache() -> None:
    with pytest.raises(UnsupportedCacheError, match="complex64") as e:
        dtype_name(mx.zeros((2,), dtype=mx.complex64))
    assert isinstance(e.value, TypeError)


def test_host_bytes_of_strided_and_scalar_arrays() -> None:
    a = mx.arange(12, dtype=mx.int32).reshape(3, 4)
    assert bytes(as_bytes(a.T)) == bytes(as_bytes(mx.contiguous(a.T)))
    assert bytes(as_bytes(mx.array(7, dtype=mx.int32))) == (7).to_bytes(4, "little")
    assert bytes(as_bytes(mx.zeros((0, 4)))) == b""


def _file(tmp_path: Path, data: bytes) -> int:
    p = tmp_path / "raw"
    p.write_bytes(data)
    return os.open(p, os.O_RDONLY)


def test_pieces_fill_a_buffer_with_room_to_grow(tmp_path: Path) -> None:
    whole = mx.arange(2 * 6, dtype=mx.float32).reshape(1, 1, 6, 2)
    spec = TensorSpec("F32", (1, 1, 6, 2))
    out, view = allocate(spec, 8, 2)  # capacity 8 along the token axis
    assert out.shape == (1, 1, 8, 2)
    first, second = whole[:, :, :4], whole[:, :, 4:]
    data = bytes(as_bytes(first)) + bytes(as_bytes(second))
    fd = _file(tmp_path, data)
    try:
        n = len(bytes(as_bytes(first)))
        first_spec, second_spec = TensorSpec("F32", (1, 1, 4, 2)), TensorSpec("F32", (1, 1, 2, 2))
        read_piece(
            fd,
            0,
            first_spec,
            view,
            alloc_shape=out.shape,
            at=0,
            axis=2,
            want=checksum(data[:n]),
            where="p",
        )
        read_piece(
            fd,
            n,
            second_spec,
            view,
            alloc_shape=out.shape,
            at=4,
            axis=2,
            want=checksum(data[n:]),
            where="p",
        )
    finally:
        os.close(fd)
    assert out[:, :, :6].tolist() == whole.tolist()


def test_a_piece_with_a_wrong_checksum_is_refused(tmp_path: Path) -> None:
    spec = TensorSpec("F32", (1, 1, 2, 2))
    out, view = allocate(spec, None, 2)
    fd = _file(tmp_path, bytes(16))
    try:
        with pytest.raises(CorruptBlobError, match="checksum"):
            read_piece(
                fd,
                0,
                spec,
                view,
                alloc_shape=out.shape,
                at=0,
                axis=2,
                want=checksum(b"other"),
                where="p",
            )
    finally:
        os.close(fd)


def _pieces(tmp_path: Path, rows: int) -> tuple[int, list[Piece], list[mx.array], list[mx.array]]:
    """Five tensors back to back in one file (one of ``rows`` rows), each read into
    its own capacity-sized buffer at position 3; the middle one is not asked for."""
    tensors = [
        mx.arange(r * 5 * 4, dtype=mx.float32).reshape(1, r, 5, 4) + i
        for i, r in enumerate([2, rows, 1, 3, 2])
    ]
    blobs = [bytes(as_bytes(t)) for t in tensors]
    fd = _file(tmp_path, b"".join(blobs))
    pieces, outs, start = [], [], 0
    for i, (t, b) in enumerate(zip(tensors, blobs, strict=True)):
        spec = TensorSpec("F32", tuple(t.shape))
        out, view = allocate(TensorSpec("F32", (1, t.shape[1], 8, 4)), None, 2)
        if i != 2:
            piece = Piece(
                start=start,
                stored=spec,
                into=view,
                alloc_shape=tuple(out.shape),
                at=3,
                axis=2,
                want=checksum(b),
                where=f"t{i}",
            )
            pieces.append(piece)
            outs.append(out)
        start += len(b)
    return fd, pieces[::-1], outs, [t for i, t in enumerate(tensors) if i != 2]


@pytest.mark.parametrize("batch", [BATCH_BYTES, 64])
def test_many_pieces_of_one_file_in_few_reads(
    batch: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensors_module, "BATCH_BYTES", batch)
    fd, pieces, outs, want = _pieces(tmp_path, IOV_MAX + 7)  # more rows than one preadv holds
    try:
        read_pieces(fd, pieces)  # in any order: read in file order
    finally:
        os.close(fd)
    for out, t in zip(outs, want, strict=True):
        assert out[:, :, 3:].tolist() == t.tolist()
        assert out[:, :, :3].tolist() == mx.zeros((1, t.shape[1], 3, 4)).tolist()


def test_damage_or_truncation_among_many_pieces_names_the_tensor(tmp_path: Path) -> None:
    fd, pieces, _, _ = _pieces(tmp_path, 4)
    damaged = [p._replace(want=checksum(b"x")) if p.where == "t3" else p for p in pieces]
    try:
        with pytest.raises(CorruptBlobError, match=r"t3.*checksum"):
            read_pieces(fd, damaged)
    finally:
        os.close(fd)
    short = tmp_path / "raw"
    short.write_bytes(short.read_bytes()[:-8])
    fd = os.open(short, os.O_RDONLY)
    try:
        with pytest.raises(CorruptBlobError, match="truncated"):
            read_pieces(fd, pieces)
    finally:
        os.close(fd)
