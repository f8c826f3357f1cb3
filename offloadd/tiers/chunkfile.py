"""The disk tier's file format: one file per chunk, a checksummed header, then the payload.

Layout (little endian)::

    header  : fixed fields, namespace, key, shard sizes; zero-padded to a multiple of ALIGN
    payload : the shards back to back, zero-padded to a multiple of ALIGN

Both parts are ALIGN-aligned so the whole file can be written and read with O_DIRECT. The
header carries the checksum of the payload and one of itself (``offloadd.checksum``:
xxh3_64), so a torn, truncated or corrupted file is recognised from its own bytes. The file's
name is a hash of the chunk's name (``file_name``); the header still names the chunk, and a
reader compares it.

Pure functions only: no I/O here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from offloadd.checksum import checksum_of

__all__ = [
    "ALIGN",
    "TEMP_SUFFIX",
    "ChunkFileError",
    "Header",
    "aligned",
    "file_name",
    "header_length",
    "header_size",
    "pack_header",
    "unpack_header",
]

ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block
MAGIC = b"ODKC"
VERSION = 2  # 1 had crc32s; its files fail header_length and are deleted at open
TEMP_SUFFIX = ".tmp"  # a file still being written; never read, removed at open

# magic, version, header length, namespace length, key length, shard count, payload length,
# payload checksum, header checksum (computed with this field zeroed).
_FIXED = struct.Struct("<4sHIHHIQQQ")
_CRC_OFFSET = _FIXED.size - 8
_CRC = struct.Struct("<Q")
_SHARD = struct.Struct("<Q")


class ChunkFileError(ValueError):
    """A header that is not one of ours, torn, or of another version."""


@dataclass(frozen=True, slots=True)
class Header:
    """What a chunk file's header says."""

    namespace: str
    key: bytes
    shard_sizes: tuple[int, ...]
    payload_length: int
    payload_sum: int  # the payload's offloadd.checksum (xxh3_64)
    length: int  # bytes of header, padding included: where the payload starts

    @property
    def file_size(self) -> int:
        """The size of the whole file this header opens."""
        return self.length + aligned(self.payload_length)


def aligned(size: int) -> int:
    """``size`` rounded up to a multiple of ALIGN."""
    return -(-size // ALIGN) * ALIGN


def file_name(namespace: str, key: bytes) -> str:
    """``"ab/ab12…"``: the chunk's file, relative to the tier's directory.

    A 128-bit hash of the length-prefixed name, fanned out over 256 directories so that no
    directory grows past a few thousand entries on a full disk.
    """
    encoded = namespace.encode()
    digest = hashlib.blake2b(
        len(encoded).to_bytes(4, "little") + encoded + key, digest_size=16
    ).hexdigest()
    return f"{digest[:2]}/{digest}"


def header_size(namespace: str, key: bytes, shards: int) -> int:
    """The length ``pack_header`` gives the header of such a chunk, padding included."""
    return aligned(_FIXED.size + len(namespace.encode()) + len(key) + shards * _SHARD.size)


def pack_header(namespace: str, key: bytes, shard_sizes: Sequence[int], payload_sum: int) -> bytes:
    """The header of a chunk of ``shard_sizes``, padded to a multiple of ALIGN."""
    encoded = namespace.encode()
    if len(encoded) > 0xFFFF or len(key) > 0xFFFF:
        raise ChunkFileError("namespace or key too long for a chunk file header")
    variable = encoded + key + b"".join(_SHARD.pack(size) for size in shard_sizes)
    length = aligned(_FIXED.size + len(variable))
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        length,
        len(encoded),
        len(key),
        len(shard_sizes),
        sum(shard_sizes),
        payload_sum & 0xFFFFFFFFFFFFFFFF,
        0,
    )
    body = bytearray(fixed + variable)
    body[_CRC_OFFSET : _CRC_OFFSET + _CRC.size] = _CRC.pack(checksum_of(body))
    return bytes(body) + bytes(length - len(body))


def header_length(block: bytes | memoryview) -> int:
    """The header's full length from its first bytes (at least ``_FIXED.size`` of them)."""
    if len(block) < _FIXED.size:
        raise ChunkFileError("truncated header")
    magic, version, length = _FIXED.unpack_from(block)[:3]
    if magic != MAGIC:
        raise ChunkFileError("not a chunk file")
    if version != VERSION:
        raise ChunkFileError(f"chunk file version {version}, expected {VERSION}")
    if length < ALIGN or length % ALIGN:
        raise ChunkFileError(f"bad header length {length}")
    return int(length)


def unpack_header(data: bytes | memoryview) -> Header:
    """The header at the start of ``data``; ChunkFileError when it is not whole and intact."""
    length = header_length(data)
    if len(data) < length:
        raise ChunkFileError("truncated header")
    (_, _, _, ns_length, key_length, shards, payload_length, payload_sum, own) = _FIXED.unpack_from(
        data
    )
    end = _FIXED.size + ns_length + key_length + shards * _SHARD.size
    if end > length:
        raise ChunkFileError("header fields overrun the header")
    body = bytearray(data[:end])
    body[_CRC_OFFSET : _CRC_OFFSET + _CRC.size] = bytes(_CRC.size)
    if checksum_of(body) != own:
        raise ChunkFileError("header checksum mismatch")
    offset = _FIXED.size
    try:
        namespace = bytes(data[offset : offset + ns_length]).decode()
    except UnicodeDecodeError:
        raise ChunkFileError("namespace is not UTF-8") from None
    offset += ns_length
    key = bytes(data[offset : offset + key_length])
    offset += key_length
    sizes = tuple(_SHARD.unpack_from(data, offset + i * _SHARD.size)[0] for i in range(shards))
    if sum(sizes) != payload_length:
        raise ChunkFileError("shard sizes do not add up to the payload length")
    return Header(namespace, key, sizes, payload_length, payload_sum, length)
