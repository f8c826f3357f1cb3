"""The disk tier's chunk file header: round trips, and every way a header is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offloadd.tiers import chunkfile
from offloadd.tiers.chunkfile import ALIGN, ChunkFileError


@given(
    namespace=st.text(max_size=300),
    key=st.binary(max_size=300),
    sizes=st.lists(st.integers(0, 1 << 40), max_size=700),
    payload_sum=st.integers(0, (1 << 64) - 1),
)
def test_round_trip(namespace: str, key: bytes, sizes: list[int], payload_sum: int) -> None:
    data = chunkfile.pack_header(namespace, key, sizes, payload_sum)
    assert len(data) % ALIGN == 0
    assert len(data) == chunkfile.header_size(namespace, key, len(sizes))
    assert chunkfile.header_length(data[:64]) == len(data)
    header = chunkfile.unpack_header(data)
    assert header.namespace == namespace
    assert header.key == key
    assert header.shard_sizes == tuple(sizes)
    assert header.payload_length == sum(sizes)
    assert header.payload_sum == payload_sum
    assert header.length == len(data)
    assert header.file_size == len(data) + chunkfile.aligned(sum(sizes))


@given(position=st.integers(0, 64), bit=st.integers(0, 7))  # 65 bytes before padding
def test_any_flipped_bit_is_refused(position: int, bit: int) -> None:
    data = bytearray(chunkfile.pack_header("ns", b"key-1", [100, 200], 1234))
    data[position] ^= 1 << bit
    with pytest.raises(ChunkFileError):
        chunkfile.unpack_header(bytes(data))


def test_a_header_of_another_version_is_refused() -> None:
    data = bytearray(chunkfile.pack_header("ns", b"k", [1, 2, 3], 7))
    assert chunkfile.VERSION == 2  # version 1 had crc32s
    data[4:6] = (1).to_bytes(2, "little")
    with pytest.raises(ChunkFileError, match="version 1"):
        chunkfile.header_length(bytes(data))
    with pytest.raises(ChunkFileError, match="version 1"):
        chunkfile.unpack_header(bytes(data))


def test_truncated_and_foreign_headers_are_refused() -> None:
    data = chunkfile.pack_header("ns", b"k", [1, 2, 3], 7)
    with pytest.raises(ChunkFileError, match="truncated"):
        chunkfile.unpack_header(data[:20])
    with pytest.raises(ChunkFileError, match="not a chunk file"):
        chunkfile.unpack_header(bytes(ALIGN))
    long_header = chunkfile.pack_header("ns", b"k", [1] * 1000, 7)  # 8000 bytes of sizes
    assert len(long_header) == 2 * ALIGN
    with pytest.raises(ChunkFileError, match="truncated"):
        chunkfile.unpack_header(long_header[:ALIGN])


def test_file_name_is_fanned_out_and_separates_namespace_from_key() -> None:
    name = chunkfile.file_name("ns", b"key")
    directory, base = name.split("/")
    assert directory == base[:2] and len(base) == 32
    assert chunkfile.file_name("ns", b"key") == name
    assert chunkfile.file_name("nsk", b"ey") != name  # the namespace is length-prefixed
    assert chunkfile.file_name("other", b"key") != name
