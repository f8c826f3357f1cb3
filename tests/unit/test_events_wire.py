"""KV-event wire format against vLLM's own struct declarations, byte for byte.

``VLLM_SOURCE`` is vLLM's declaration text (vllm/distributed/kv_events.py, v0.33 field
set: the declarations of 0181ea31 with array_like on EventBatch as on main, plus
locality/ownership/session_id; the ``__hash__`` methods are left out, they play no part in
encoding). It is executed into its own module, ``vllm_structs``, because the tag of each
event is its class name: the classes must be called exactly ``BlockStored`` etc. without
clashing with ours.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import events as ours
from protocol.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    hash_for_wire,
)

VLLM_SOURCE = '''
from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,
):
    """Base class for all KV cache-related events"""


MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int

    lora_id: int | None
    """Deprecated: use `lora_name` for KV block key hash.
    Retained for backward compatibility.
    """

    medium: str | None
    lora_name: str | None

    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
'''

# vLLM <= 0.23: the same events as tagged arrays (KVCacheEvent had array_like=True).
VLLM_0_23_SOURCE = VLLM_SOURCE.replace(
    "    omit_defaults=True,  # type: ignore[call-arg]\n    gc=False,  # type: ignore[call-arg]\n"
    "    tag=True,",
    "    array_like=True,  # type: ignore[call-arg]\n"
    "    omit_defaults=True,  # type: ignore[call-arg]\n    gc=False,  # type: ignore[call-arg]\n"
    "    tag=True,",
)

# The first release with events (vllm b4e69e0, verbatim but for Optional/Union spelling).
VLLM_FIRST_SOURCE = '''
from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
'''


def _load(name: str, source: str) -> Any:
    module = types.ModuleType(name)
    sys.modules[name] = module  # msgspec resolves annotations through the module
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


vllm_structs = _load("vllm_structs", VLLM_SOURCE)
vllm_0_23 = _load("vllm_0_23_structs", VLLM_0_23_SOURCE)
vllm_first = _load("vllm_first_structs", VLLM_FIRST_SOURCE)

ALL_FIELDS_STORED: dict[str, Any] = {
    "block_hashes": [2**64 - 1, b"\x01" * 32],
    "parent_block_hash": 12345,
    "token_ids": [0, 127, 128, 65535, 2**31],
    "block_size": 16,
    "lora_id": 7,
    "medium": MEDIUM_CPU,
    "lora_name": "adapter",
    "extra_keys": [("lora", 1), None],
    "group_idx": 1,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": 4096,
    "locality": "LOCAL",
    "ownership": "offloadd",
    "session_id": "req-1",
    "lookahead_token_ids": [[1, 2], [3]],
}
ALL_FIELDS_REMOVED: dict[str, Any] = {
    "block_hashes": [3, b"\xff" * 16],
    "medium": MEDIUM_STORAGE,
    "group_idx": 2,
    "locality": "REMOTE",
    "ownership": "offloadd",
}


def _stored(hashes: list[bytes | int], **fields: Any) -> BlockStored:
    base: dict[str, Any] = {
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": MEDIUM_CPU,
        "lora_name": None,
    }
    return BlockStored(block_hashes=hashes, **{**base, **fields})


def _both(module: Any) -> tuple[Any, Any]:
    batch = module.KVEventBatch(
        ts=1789095808.83,
        events=[
            module.BlockStored(**ALL_FIELDS_STORED),
            module.BlockRemoved(**ALL_FIELDS_REMOVED),
            module.AllBlocksCleared(),
        ],
        data_parallel_rank=3,
    )
    return batch, msgspec.msgpack.Encoder().encode(batch)


# --- Declarations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
)
def test_declarations_match_vllm(name: str) -> None:
    mine, theirs = getattr(ours, name), getattr(vllm_structs, name)
    assert mine.__name__ == theirs.__name__
    mine_config, their_config = mine.__struct_config__, theirs.__struct_config__
    for option in (
        "array_like",
        "omit_defaults",
        "gc",
        "tag",
        "tag_field",
        "forbid_unknown_fields",
    ):
        assert getattr(mine_config, option) == getattr(their_config, option), option
    mine_fields = msgspec.structs.fields(mine)
    their_fields = msgspec.structs.fields(theirs)
    assert [(f.name, f.default, f.type) for f in mine_fields] == [
        (f.name, f.default, f.type) for f in their_fields
    ]


@pytest.mark.parametrize(
    "name", ["KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
)
def test_declarations_match_the_installed_vllm(name: str) -> None:
    """The copy above is checked against vLLM 0.33 itself where it is installed (CI)."""
    installed = pytest.importorskip("vllm.distributed.kv_events")
    mine, theirs = getattr(ours, name), getattr(installed, name)
    assert [(f.name, f.default, f.type) for f in msgspec.structs.fields(mine)] == [
        (f.name, f.default, f.type) for f in msgspec.structs.fields(theirs)
    ]


def test_batch_declaration_matches_vllm() -> None:
    mine = msgspec.structs.fields(KVEventBatch)
    theirs = msgspec.structs.fields(vllm_structs.KVEventBatch)
    assert [(f.name, f.default) for f in mine] == [(f.name, f.default) for f in theirs]
    assert KVEventBatch.__struct_config__.array_like
    assert (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE) == (
        vllm_structs.MEDIUM_GPU,
        vllm_structs.MEDIUM_CPU,
        vllm_structs.MEDIUM_STORAGE,
    )


# --- Both directions, field by field ---------------------------------------------------


def test_our_payload_decodes_with_vllm_structs_field_by_field() -> None:
    batch, _ = _both(ours)
    decoded = msgspec.msgpack.decode(encode_batch(batch), type=vllm_structs.KVEventBatch)
    assert decoded.ts == batch.ts
    assert decoded.data_parallel_rank == 3
    assert [type(event).__name__ for event in decoded.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    for name, value in ALL_FIELDS_STORED.items():
        expected = value if name != "extra_keys" else [("lora", 1), None]
        assert getattr(decoded.events[0], name) == expected, name
    for name, value in ALL_FIELDS_REMOVED.items():
        assert getattr(decoded.events[1], name) == value, name


def test_vllm_payload_decodes_with_ours() -> None:
    their_batch, payload = _both(vllm_structs)
    decoded = decode_batch(payload)
    assert decoded == _both(ours)[0]
    for name in ALL_FIELDS_STORED:
        assert getattr(decoded.events[0], name) == getattr(their_batch.events[0], name), name


def test_same_bytes_as_vllm() -> None:
    assert _both(ours)[1] == _both(vllm_structs)[1]
    minimal_ours = KVEventBatch(ts=0.5, events=[_stored([1])], data_parallel_rank=0)
    minimal_theirs = vllm_structs.KVEventBatch(
        ts=0.5,
        events=[
            vllm_structs.BlockStored(
                block_hashes=[1],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
        ],
        data_parallel_rank=0,
    )
    assert encode_batch(minimal_ours) == msgspec.msgpack.encode(minimal_theirs)


# --- Bytes ------------------------------------------------------------------------------


def test_outer_array_events_maps_defaults_omitted_required_present() -> None:
    batch = KVEventBatch(
        ts=2.5,
        events=[
            _stored([hash_for_wire(b"\xaa" * 32)], token_ids=[1, 2], block_size=2, group_idx=0),
            BlockRemoved(block_hashes=[5], medium=MEDIUM_CPU),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = encode_batch(batch)
    assert payload[0] == 0x93  # fixarray of 3: [ts, events, data_parallel_rank]
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 2.5
    assert raw[2] == 0
    stored, removed, cleared = raw[1]
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [int.from_bytes(b"\xaa" * 8, "big")],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "group_idx": 0,
    }
    assert list(stored)[:2] == ["type", "block_hashes"]
    assert "parent_block_hash" in stored and "lora_id" in stored and "lora_name" in stored
    assert removed == {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU"}
    assert cleared == {"type": "AllBlocksCleared"}


def test_array_like_keeps_every_element() -> None:
    # msgspec ignores omit_defaults for array_like structs (jcrist/msgspec#720): a None rank
    # is sent as nil, exactly as vLLM's own struct sends it; shorter arrays still decode.
    payload = encode_batch(KVEventBatch(ts=1.0, events=[]))
    assert msgspec.msgpack.decode(payload) == [1.0, [], None]
    assert payload == msgspec.msgpack.encode(vllm_structs.KVEventBatch(ts=1.0, events=[]))
    assert decode_batch(payload).data_parallel_rank is None
    assert decode_batch(msgspec.msgpack.encode([1.0, []])) == KVEventBatch(ts=1.0, events=[])


def test_hash_for_wire() -> None:
    digest = bytes(range(32))
    assert hash_for_wire(digest) == int.from_bytes(digest[-8:], "big")
    assert hash_for_wire(digest, as_int=True) == 0x18191A1B1C1D1E1F
    assert hash_for_wire(digest, as_int=False) == digest
    assert hash_for_wire(b"\xff" * 16) == 2**64 - 1
    assert hash_for_wire(b"\x01") == 1
    assert isinstance(hash_for_wire(bytearray(b"ab"), as_int=False), bytes)  # type: ignore[arg-type]


# --- Legacy and forward compatibility ---------------------------------------------------


def test_legacy_tagged_arrays_decode() -> None:
    payload = msgspec.msgpack.encode(
        [
            3.0,
            [
                ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None],
                ["BlockStored", [3], 2, [9, 10], 2, None, "CPU", "lora", [None], 1],
                ["BlockRemoved", [1], "GPU"],
                ["AllBlocksCleared"],
            ],
            1,
        ]
    )
    decoded = decode_batch(payload)
    assert decoded == KVEventBatch(
        ts=3.0,
        events=[
            _stored([1, 2], token_ids=[5, 6, 7, 8], block_size=2, medium="GPU"),
            _stored(
                [3],
                parent_block_hash=2,
                token_ids=[9, 10],
                block_size=2,
                lora_name="lora",
                extra_keys=[None],
                group_idx=1,
            ),
            BlockRemoved(block_hashes=[1], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )


def test_vllm_0_23_payload_decodes() -> None:
    _, payload = _both(vllm_0_23)
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # tagged array
    minimal = vllm_0_23.BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    # Every field is on the wire, None as nil (no trailing omission for arrays).
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(minimal)) == [
        "BlockStored",
        [1],
        None,
        [],
        0,
        None,
        "CPU",
        None,
        *[None] * 8,
    ]
    assert decode_batch(payload) == _both(ours)[0]


def test_first_vllm_release_payload_decodes() -> None:
    payload = msgspec.msgpack.encode(
        vllm_first.KVEventBatch(
            ts=1.0,
            events=[
                vllm_first.BlockStored(
                    block_hashes=[7],
                    parent_block_hash=None,
                    token_ids=[1],
                    block_size=1,
                    lora_id=None,
                ),
                vllm_first.BlockRemoved(block_hashes=[7]),
            ],
        )
    )
    decoded = decode_batch(payload)
    assert decoded.events == [
        _stored([7], token_ids=[1], block_size=1, medium=None),
        BlockRemoved(block_hashes=[7], medium=None),
    ]
    assert decoded.data_parallel_rank is None


def test_unknown_fields_are_ignored() -> None:
    future_map = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1],
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 0,
                    "lora_id": None,
                    "medium": "CPU",
                    "lora_name": None,
                    "event_version": 1,
                    "brand_new": {"nested": [1, 2]},
                },
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "x": None},
            ],
            0,
        ]
    )
    assert decode_batch(future_map).events == [
        _stored([1]),
        BlockRemoved(block_hashes=[1], medium="CPU"),
    ]
    longer_array = msgspec.msgpack.encode(
        [1.0, [["BlockRemoved", [1], "CPU", 0, None, None, "future", 42]], 0]
    )
    assert decode_batch(longer_array).events == [
        BlockRemoved(block_hashes=[1], medium="CPU", group_idx=0)
    ]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode(1),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]),
        msgspec.msgpack.encode([1.0, [["Nope"]], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}], 0]),  # required fields
        msgspec.msgpack.encode(["x", [], 0]),
    ],
)
def test_not_a_batch_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(payload)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_decode_error(payload: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError):
        decode_batch(payload)


# --- Round trips ---------------------------------------------------------------------

hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))
opt_str = st.none() | st.text(max_size=8)
opt_int = st.none() | st.integers(0, 2**31)
scalars = st.one_of(st.text(max_size=6), st.integers(-(2**63), 2**63 - 1), st.binary(max_size=6))
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=4),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    block_size=st.integers(0, 1024),
    lora_id=opt_int,
    medium=st.none() | st.sampled_from([MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE]),
    lora_name=opt_str,
    extra_keys=st.none() | st.lists(st.none() | st.tuples(scalars, scalars), max_size=3),
    group_idx=opt_int,
    kv_cache_spec_kind=opt_str,
    kv_cache_spec_sliding_window=opt_int,
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=opt_str,
    session_id=opt_str,
)
removed_events = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=4),
    medium=st.none() | st.sampled_from([MEDIUM_GPU, MEDIUM_CPU]),
    group_idx=opt_int,
    locality=opt_str,
    ownership=opt_str,
)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(
        st.one_of(stored_events, removed_events, st.just(AllBlocksCleared())), max_size=5
    ),
    data_parallel_rank=st.none() | st.integers(0, 64),
)


def _as(module: Any, batch: KVEventBatch) -> Any:
    """The same batch built from another set of declarations."""
    return module.KVEventBatch(
        ts=batch.ts,
        events=[
            getattr(module, type(event).__name__)(**msgspec.structs.asdict(event))
            for event in batch.events
        ],
        data_parallel_rank=batch.data_parallel_rank,
    )


@settings(max_examples=300, deadline=None)
@given(batches)
def test_round_trip_ours_and_vllm(batch: KVEventBatch) -> None:
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    theirs = msgspec.msgpack.decode(payload, type=vllm_structs.KVEventBatch)
    assert theirs == _as(vllm_structs, batch)
    assert msgspec.msgpack.encode(theirs) == payload
    assert decode_batch(msgspec.msgpack.encode(_as(vllm_structs, batch))) == batch


@settings(max_examples=200, deadline=None)
@given(batches)
def test_round_trip_legacy_encoding(batch: KVEventBatch) -> None:
    assert decode_batch(msgspec.msgpack.encode(_as(vllm_0_23, batch))) == batch
