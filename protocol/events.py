"""KV-cache events on the wire, exactly as vLLM declares and encodes them.

The structs below mirror ``vllm/distributed/kv_events.py`` field for field, in declaration
order and with the same struct options, so a stock vLLM subscriber decodes what the daemon
publishes and the daemon's subscriber decodes what vLLM publishes:

* ``KVEventBatch`` is a msgpack array ``[ts, events, data_parallel_rank]`` (``array_like``;
  msgspec ignores ``omit_defaults`` for arrays, so a ``None`` rank is sent as nil).
* Each event is a msgpack map tagged ``"type"`` with the class name (``"BlockStored"``,
  ``"BlockRemoved"``, ``"AllBlocksCleared"``). Fields that still hold their default are
  omitted; required fields are always present, even when ``None``.
* Block hashes are what ``hash_for_wire`` returns: the low 64 bits as an unsigned int
  (vLLM's default) or the raw digest bytes.

``decode_batch`` also accepts the legacy encoding of vLLM <= 0.23, where each event is a
tagged array ``["BlockStored", block_hashes, parent, token_ids, ...]`` (shorter arrays from
releases with fewer fields too, longer ones from newer releases), and ignores map keys it
does not know (fields added by later vLLM versions).

Live messages and replay (the socket protocol, implemented in ``offloadd.server.publisher`` and
``offloadd.subscriber``):

* PUB frames ``[topic, seq, payload]``: ``seq`` is 8 bytes big-endian, +1 per batch from 0
  for a publisher's lifetime; ``payload`` is ``encode_batch(batch)``.
* Replay ROUTER: request ``[b"", start_seq]`` (8 bytes big-endian; a REQ socket adds the
  empty frame itself); one reply ``[b"", topic, seq, payload]`` per buffered batch with
  ``seq >= start_seq``, then the end marker ``[b"", b"", END_SEQ, b""]``. Before vLLM 0.26
  replies had no topic frame: ``[b"", seq, payload]`` and ``[b"", END_SEQ, b""]``.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"  # a tier below host memory: the daemon's disk, or its cluster
# vLLM 0.33's ``Locality`` of a tier relative to the publisher (``locality`` of an event).
LOCALITY_LOCAL = "LOCAL"  # on the publishing node (the daemon's disk tier)
LOCALITY_REMOTE = "REMOTE"  # elsewhere (the cluster tier)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay end marker (all 0xFF)."""

ExternalBlockHash = bytes | int
"""A block hash as published: the low 64 bits as an int, or the raw digest bytes."""

_LOW_64 = (1 << 64) - 1


def hash_for_wire(block_hash: bytes, as_int: bool = True) -> int | bytes:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits (big-endian) or the bytes."""
    if as_int:
        return int.from_bytes(block_hash, "big") & _LOW_64
    return bytes(block_hash)


# The declarations below are vLLM's (v0.33, vllm/distributed/kv_events.py). Keep the field
# order, defaults and struct options identical: they are the wire.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events published in one message: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV-cache events (a map tagged ``"type"`` with the class name)."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks became available on ``medium``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, use lora_name
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None  # vLLM 0.33; the daemon sends none


class BlockRemoved(KVCacheEvent):
    """Blocks are no longer available on ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """An ``EventBatch`` whose events are KV-cache events."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# Legacy (<= v0.23) twins: the same fields, events as tagged arrays. ``medium`` and
# ``lora_name`` default to None here because the oldest releases did not send them.


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_LEGACY_DECODER = msgspec.msgpack.Decoder(_LegacyBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of one live or replayed message."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload in either encoding (events as maps, or legacy tagged arrays).

    Raises ``msgspec.DecodeError`` (``msgspec.ValidationError`` when the msgpack is well
    formed but is not a KV event batch).
    """
    try:
        return _DECODER.decode(payload)
    except msgspec.ValidationError as current_error:
        try:
            legacy = _LEGACY_DECODER.decode(payload)
        except msgspec.DecodeError:
            raise current_error from None
    return KVEventBatch(
        ts=legacy.ts,
        events=[_from_legacy(event) for event in legacy.events],
        data_parallel_rank=legacy.data_parallel_rank,
    )


def _from_legacy(
    event: _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared,
) -> KVEvent:
    match event:
        case _LegacyBlockStored():
            return BlockStored(**msgspec.structs.asdict(event))
        case _LegacyBlockRemoved():
            return BlockRemoved(**msgspec.structs.asdict(event))
        case _LegacyAllBlocksCleared():
            return AllBlocksCleared()
