"""protocol.messages: round trips, wire tags, schema evolution, and the decoder against garbage."""

from __future__ import annotations

import contextlib
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from protocol.handles import CudaIpcHandle, KVRegion, ShmHandle
from protocol.messages import (
    Ack,
    Bye,
    CacheListing,
    Clear,
    ClearCache,
    DaemonStats,
    EngineReady,
    EngineState,
    EngineUsage,
    Error,
    GetStats,
    Hello,
    HoldKeys,
    HoldResult,
    JobAccepted,
    JobDone,
    JobsDone,
    KeysChanged,
    ListCache,
    Load,
    Lookup,
    LookupResult,
    NamespaceUsage,
    Ok,
    Ping,
    Release,
    Reply,
    Request,
    Reserve,
    Reserved,
    Segment,
    StatsResult,
    StepJobs,
    Store,
    UpdateHolds,
    Wait,
    WaitResult,
    Welcome,
    decode_reply,
    decode_request,
    encode,
    peek_request_id,
)
from tests.strategies import offloading_configs

# --- strategies ---------------------------------------------------------------------------

# msgpack carries integers in [-2**63, 2**64); the extremes must survive.
wire_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
small_ints = st.integers(min_value=0, max_value=1 << 20)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
keys = st.lists(st.binary(min_size=0, max_size=40), max_size=8)
block_ids = st.lists(wire_ints, max_size=16)
names = st.text(max_size=12)
# extra_config is dict[str, Any]: only values that come back as the same Python value.
json_scalars = st.one_of(st.none(), st.booleans(), wire_ints, finite_floats, names)
extra_configs = st.dictionaries(
    names, st.one_of(json_scalars, st.lists(json_scalars, max_size=3)), max_size=4
)

configs = offloading_configs(small_ints, names, extra_configs)

memory_handles = st.one_of(
    st.builds(ShmHandle, path=names, offset=wire_ints, size=wire_ints),
    st.builds(
        CudaIpcHandle,
        device_uuid=names,
        handle=st.binary(max_size=64),
        storage_size=wire_ints,
        storage_offset=wire_ints,
        ref_counter_handle=st.binary(max_size=16),
        ref_counter_offset=wire_ints,
        event_handle=st.binary(max_size=64),
        event_sync_required=st.booleans(),
        offset=wire_ints,
        size=wire_ints,
    ),
)

regions = st.builds(
    KVRegion,
    handle=memory_handles,
    num_blocks=wire_ints,
    page_size=wire_ints,
    block_stride=wire_ints,
    layer_names=st.lists(names, max_size=3).map(tuple),
)

segments = st.lists(st.builds(Segment, wire_ints, wire_ints, wire_ints), max_size=4)
holds = st.lists(st.builds(HoldKeys, names, keys), max_size=3)
requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(
        Hello,
        request_id=wire_ints,
        protocol_version=wire_ints,
        role=st.sampled_from(["worker", "scheduler"]),
        config=configs,
        regions=st.lists(regions, max_size=3).map(tuple),
        device_uuid=names,
        pid=wire_ints,
        client_name=names,
        kv_events_topic=names,
        kv_events_raw_hashes=st.booleans(),
        pid_namespace=wire_ints,
        mirror=st.booleans(),
    ),
    st.builds(
        Lookup, request_id=wire_ints, keys=keys, pin=st.booleans(), lease_seconds=finite_floats
    ),
    st.builds(
        Store,
        request_id=wire_ints,
        job_id=wire_ints,
        keys=keys,
        block_ids=block_ids,
        wait_event=st.binary(max_size=64),
        segments=segments,
        reserved=st.booleans(),
    ),
    st.builds(
        Load,
        request_id=wire_ints,
        job_id=wire_ints,
        keys=keys,
        block_ids=block_ids,
        skip=wire_ints,
        wait_event=st.binary(max_size=64),
        segments=segments,
        hold=names,
    ),
    st.builds(Reserve, request_id=wire_ints, keys=keys, holds=holds, ack=wire_ints, release=holds),
    st.builds(UpdateHolds, request_id=wire_ints, hold=holds, release=holds, ack=wire_ints),
    st.builds(Ack, request_id=wire_ints, seq=wire_ints),
    st.builds(Release, request_id=wire_ints, keys=keys),
    st.builds(
        Wait, request_id=wire_ints, job_ids=st.lists(wire_ints, max_size=8), timeout=finite_floats
    ),
    st.builds(GetStats, request_id=wire_ints),
    st.builds(Bye, request_id=wire_ints),
    st.builds(Clear, request_id=wire_ints),
    st.builds(Ping, request_id=wire_ints, session=names),
    st.builds(ListCache, request_id=wire_ints, token=st.binary(max_size=32)),
    st.builds(
        ClearCache,
        request_id=wire_ints,
        token=st.binary(max_size=32),
        all=st.booleans(),
        namespace=names,
        engine_id=names,
    ),
    st.builds(
        StepJobs,
        request_id=wire_ints,
        jobs=st.lists(
            st.one_of(
                st.builds(
                    Store,
                    request_id=wire_ints,
                    job_id=wire_ints,
                    keys=keys,
                    block_ids=block_ids,
                    segments=segments,
                    reserved=st.booleans(),
                ),
                st.builds(
                    Load,
                    request_id=wire_ints,
                    job_id=wire_ints,
                    keys=keys,
                    block_ids=block_ids,
                    segments=segments,
                    hold=names,
                ),
            ),
            max_size=3,
        ),
    ),
)

engine_states = st.builds(
    EngineState,
    engine_id=names,
    data_parallel_index=wire_ints,
    world_size=wire_ints,
    ready=st.booleans(),
    ranks_present=st.lists(wire_ints, max_size=4),
    namespace=names,
    schedulers=wire_ints,
)

job_dones = st.builds(
    JobDone,
    job_id=wire_ints,
    ok=st.booleans(),
    failed_keys=keys,
    nbytes=wire_ints,
    seconds=finite_floats,
    error=names,
    code=wire_ints,
)

replies: st.SearchStrategy[Reply] = st.one_of(
    st.builds(
        CacheListing,
        request_id=wire_ints,
        namespaces=st.lists(
            st.builds(
                NamespaceUsage,
                name=names,
                tenant=names,
                chunks=wire_ints,
                nbytes=wire_ints,
                hits=wire_ints,
                misses=wire_ints,
                last_use=finite_floats,
                engines=st.lists(names, max_size=3),
            ),
            max_size=3,
        ),
        engines=st.lists(
            st.builds(
                EngineUsage,
                engine_id=names,
                data_parallel_index=wire_ints,
                namespace=names,
                connected=st.booleans(),
                hits=wire_ints,
                misses=wire_ints,
                last_use=finite_floats,
            ),
            max_size=3,
        ),
    ),
    st.builds(
        Welcome,
        request_id=wire_ints,
        protocol_version=wire_ints,
        session_id=names,
        engine=engine_states,
    ),
    st.builds(EngineReady, engine=engine_states),
    st.builds(
        LookupResult,
        request_id=wire_ints,
        hits=wire_ints,
        pending=st.lists(wire_ints, max_size=8),
        pinned=wire_ints,
    ),
    st.builds(JobAccepted, request_id=wire_ints, job_id=wire_ints),
    job_dones,
    st.builds(JobsDone, dones=st.lists(job_dones, max_size=4)),
    st.builds(
        WaitResult,
        request_id=wire_ints,
        done=st.lists(job_dones, max_size=3),
        pending=st.lists(wire_ints, max_size=4),
    ),
    st.builds(
        StatsResult,
        request_id=wire_ints,
        stats=st.builds(
            DaemonStats,
            uptime_seconds=finite_floats,
            capacity_bytes=wire_ints,
            used_bytes=wire_ints,
            entries=wire_ints,
            committed_entries=wire_ints,
            lookups=wire_ints,
            hits=wire_ints,
            misses=wire_ints,
            stores_refused=wire_ints,
            evictions=wire_ints,
            bytes_stored=wire_ints,
            bytes_loaded=wire_ints,
            protocol_errors=wire_ints,
            sessions=wire_ints,
            engines=st.lists(engine_states, max_size=2),
        ),
    ),
    st.builds(Ok, request_id=wire_ints, count=wire_ints),
    st.builds(Error, request_id=wire_ints, code=wire_ints, message=names),
    st.builds(Reserved, request_id=wire_ints, reserved=st.lists(wire_ints, max_size=8)),
    st.builds(HoldResult, request_id=wire_ints, held=wire_ints, missing=keys),
    st.builds(
        KeysChanged,
        seq=wire_ints,
        stored=keys,
        removed=keys,
        reset=st.booleans(),
        more=st.booleans(),
    ),
)


def _config() -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1")),),
        worker_kv_bytes_per_block=256,
        enable_kv_cache_events=True,
        extra_config={"namespace": "salt"},
        engine_id="engine-a",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=1,
            world_size=2,
            tp_size=2,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=3,
            is_parallelism_agnostic=True,
        ),
    )


def _hello() -> Hello:
    region = KVRegion(
        handle=ShmHandle(path="/dev/shm/kv", offset=0, size=1024),
        num_blocks=8,
        page_size=128,
        block_stride=128,
        layer_names=("l0", "l1"),
    )
    return Hello(
        request_id=5,
        protocol_version=1,
        role="worker",
        config=_config(),
        regions=(region,),
        device_uuid="GPU-1",
        pid=1234,
        client_name="rank-1",
    )


def _raw(message: Request | Reply) -> dict[str, Any]:
    raw = msgspec.msgpack.decode(encode(message))
    assert isinstance(raw, dict)
    return raw


# --- round trips --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(requests)
def test_every_request_round_trips(message: Request) -> None:
    decoded = decode_request(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@settings(max_examples=150, deadline=None)
@given(replies)
def test_every_reply_round_trips(message: Reply) -> None:
    decoded = decode_reply(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_round_trip_accepts_memoryview_frames() -> None:
    frame = encode(_hello())
    assert decode_request(memoryview(frame)) == _hello()
    assert decode_reply(memoryview(encode(Ok(9, 2)))) == Ok(9, 2)


def test_hello_round_trip_keeps_nested_types() -> None:
    decoded = decode_request(encode(_hello()))
    assert isinstance(decoded, Hello)
    assert isinstance(decoded.regions, tuple)
    assert isinstance(decoded.regions[0].handle, ShmHandle)
    assert isinstance(decoded.config.groups[0].layer_names, tuple)
    assert decoded.config.parallel.data_parallel_index == 3


# --- wire tags ----------------------------------------------------------------------------

REQUEST_TAGS: dict[type, str] = {
    Hello: "hello",
    Lookup: "lookup",
    Store: "store",
    Load: "load",
    Release: "release",
    Wait: "wait",
    GetStats: "stats",
    Clear: "clear",
    Ping: "ping",
    Bye: "bye",
    Reserve: "reserve",
    UpdateHolds: "holds",
    Ack: "ack",
    StepJobs: "step_jobs",
    ListCache: "cache_ls",
    ClearCache: "cache_clear",
}
REPLY_TAGS: dict[type, str] = {
    Welcome: "welcome",
    EngineReady: "ready",
    LookupResult: "lookup_r",
    JobAccepted: "accepted",
    JobDone: "done",
    JobsDone: "dones",
    WaitResult: "wait_r",
    StatsResult: "stats_r",
    Ok: "ok",
    Error: "error",
    Reserved: "reserved",
    HoldResult: "holds_r",
    KeysChanged: "keys",
    CacheListing: "cache_ls_r",
}


def test_unions_hold_exactly_the_tagged_types() -> None:
    assert set(typing.get_args(Request)) == set(REQUEST_TAGS)
    assert set(typing.get_args(Reply)) == set(REPLY_TAGS)
    all_tags = list(REQUEST_TAGS.values()) + list(REPLY_TAGS.values())
    assert len(all_tags) == len(set(all_tags))


@settings(max_examples=60, deadline=None)
@given(requests)
def test_request_wire_tag_is_the_declared_short_string(message: Request) -> None:
    assert _raw(message)["type"] == REQUEST_TAGS[type(message)]


@settings(max_examples=60, deadline=None)
@given(replies)
def test_reply_wire_tag_is_the_declared_short_string(message: Reply) -> None:
    assert _raw(message)["type"] == REPLY_TAGS[type(message)]


def test_messages_are_maps_keyed_by_field_name() -> None:
    raw = _raw(Store(request_id=3, job_id=4, keys=[b"k"], block_ids=[1, 2]))
    assert raw == {
        "type": "store",
        "request_id": 3,
        "job_id": 4,
        "keys": [b"k"],
        "block_ids": [1, 2],
        "wait_event": b"",
        "segments": [],
        "reserved": False,
        "deadline": 0.0,
        "reserver": "",
        "reserve_id": 0,
    }


def test_segments_and_holds_are_arrays() -> None:
    raw = _raw(Reserve(request_id=1, keys=[], holds=[HoldKeys("req-1", [b"k"])]))
    assert raw["holds"] == [["req-1", [b"k"]]]
    raw = _raw(Load(1, 2, [b"k"], [5], segments=[Segment(1, 1, 1)], hold="req-1"))
    assert raw["segments"] == [[1, 1, 1]]
    assert raw["hold"] == "req-1"


def test_handle_tags_inside_hello() -> None:
    raw = _raw(_hello())
    assert raw["regions"][0]["handle"]["type"] == "shm"
    cuda = CudaIpcHandle(
        device_uuid="GPU-x",
        handle=b"h",
        storage_size=1,
        storage_offset=0,
        ref_counter_handle=b"r",
        ref_counter_offset=0,
        event_handle=b"e",
        event_sync_required=False,
        offset=0,
        size=1,
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cuda))["type"] == "cuda"


# --- bad input ----------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_msgspec_errors(frame: bytes) -> None:
    for decode in (decode_request, decode_reply):
        # ValidationError is a DecodeError; anything else escapes and fails the test.
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            decode(frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_peek_request_id_never_raises(frame: bytes) -> None:
    assert isinstance(peek_request_id(frame), int)


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_deeply_nested_frames_are_decode_errors(depth: int) -> None:
    # msgspec stops at the interpreter's recursion limit with RecursionError; the daemon only
    # counts DecodeError/ValidationError as a malformed frame, so that must be what surfaces.
    nested = b"\x91" * depth + b"\x00"
    with pytest.raises(msgspec.DecodeError):
        decode_request(nested)
    with pytest.raises(msgspec.DecodeError):
        decode_reply(nested)
    assert peek_request_id(nested) == 0


def test_deep_nesting_inside_a_hello_is_a_decode_error() -> None:
    raw = _raw(_hello())
    raw["config"]["extra_config"] = {"k": "PLACEHOLDER"}
    frame = msgspec.msgpack.encode(raw).replace(
        msgspec.msgpack.encode("PLACEHOLDER"), b"\x91" * 5_000 + b"\x00"
    )
    with pytest.raises(msgspec.DecodeError):
        decode_request(frame)
    assert peek_request_id(frame) in (0, 5)  # best effort; it must not raise


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "nope", "request_id": 1},
        {"type": "welcome", "request_id": 1},  # a reply tag is not a request
        {"request_id": 1, "keys": []},  # no tag at all
        {"type": 7, "request_id": 1},
    ],
)
def test_unknown_or_missing_request_tag_is_a_validation_error(raw: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_request(msgspec.msgpack.encode(raw))


def test_request_tag_is_not_a_reply() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_reply(encode(GetStats(request_id=1)))


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ({"type": "lookup", "request_id": "1", "keys": []}, "request_id"),
        ({"type": "lookup", "request_id": True, "keys": []}, "request_id"),
        ({"type": "lookup", "request_id": 1, "keys": [1, 2]}, "keys"),
        ({"type": "lookup", "request_id": 1, "keys": "abc"}, "keys"),
        ({"type": "lookup", "request_id": 1, "keys": [], "pin": "yes"}, "pin"),
        (
            {"type": "store", "request_id": 1, "job_id": 2, "keys": [], "block_ids": [1.5]},
            "block_ids",
        ),
        (
            {"type": "store", "request_id": 1, "job_id": 2, "keys": [], "block_ids": None},
            "block_ids",
        ),
        ({"type": "store", "request_id": 1, "job_id": 2, "keys": []}, "block_ids"),
        ({"type": "wait", "request_id": 1, "job_ids": [1], "timeout": "soon"}, "timeout"),
    ],
)
def test_wrong_field_types_are_validation_errors(raw: dict[str, Any], where: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=where):
        decode_request(msgspec.msgpack.encode(raw))


def test_hello_with_a_bad_role_or_nested_field_is_a_validation_error() -> None:
    raw = _raw(_hello())
    raw["role"] = "admin"
    with pytest.raises(msgspec.ValidationError, match="role"):
        decode_request(msgspec.msgpack.encode(raw))
    raw = _raw(_hello())
    raw["config"]["parallel"]["rank"] = "one"
    with pytest.raises(msgspec.ValidationError, match="rank"):
        decode_request(msgspec.msgpack.encode(raw))
    raw = _raw(_hello())
    raw["regions"][0]["handle"]["type"] = "nfs"
    with pytest.raises(msgspec.ValidationError):
        decode_request(msgspec.msgpack.encode(raw))


# --- peek_request_id ----------------------------------------------------------------------


def test_peek_finds_the_id_of_a_map_with_a_bad_field() -> None:
    frame = msgspec.msgpack.encode({"type": "lookup", "request_id": 42, "keys": "not a list"})
    with pytest.raises(msgspec.ValidationError):
        decode_request(frame)
    assert peek_request_id(frame) == 42


def test_peek_finds_the_id_behind_an_unknown_tag() -> None:
    assert peek_request_id(msgspec.msgpack.encode({"type": "zzz", "request_id": 2**64 - 1})) == (
        2**64 - 1
    )


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"\x81\xaarequest_id",  # truncated map
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode(17),
        msgspec.msgpack.encode({"type": "lookup"}),
        msgspec.msgpack.encode({"type": "lookup", "request_id": "17"}),
        msgspec.msgpack.encode({"type": "lookup", "request_id": True}),
        msgspec.msgpack.encode({"type": "lookup", "request_id": 1.0}),
        msgspec.msgpack.encode({"request_id": 17}) + b"\x00",  # trailing bytes
    ],
)
def test_peek_returns_zero_for_garbage(frame: bytes) -> None:
    assert peek_request_id(frame) == 0


# --- schema evolution ---------------------------------------------------------------------


def test_hello_from_an_older_peer_without_appended_fields_decodes() -> None:
    raw = _raw(_hello())
    for appended in ("client_name", "pid", "device_uuid"):
        del raw[appended]
    del raw["config"]["num_cpu_blocks"]
    del raw["config"]["replicated_layout"]
    decoded = decode_request(msgspec.msgpack.encode(raw))
    assert isinstance(decoded, Hello)
    assert decoded.client_name == ""
    assert decoded.pid == 0
    assert decoded.device_uuid == ""
    assert decoded.config.replicated_layout is False
    assert decoded.config.num_cpu_blocks is None
    assert decoded.regions == _hello().regions


@pytest.mark.parametrize(
    ("message", "dropped", "default"),
    [
        (Lookup(request_id=1, keys=[b"a"], pin=True, lease_seconds=3.0), "lease_seconds", 0.0),
        (Lookup(request_id=1, keys=[b"a"], pin=True), "pin", False),
        (Load(request_id=1, job_id=2, keys=[b"a"], block_ids=[3], skip=1), "skip", 0),
    ],
)
def test_requests_without_defaulted_fields_decode(
    message: Request, dropped: str, default: object
) -> None:
    raw = _raw(message)
    del raw[dropped]
    decoded = decode_request(msgspec.msgpack.encode(raw))
    assert getattr(decoded, dropped) == default


def test_replies_without_defaulted_fields_decode() -> None:
    raw = _raw(Ok(request_id=4, count=9))
    del raw["count"]
    assert decode_reply(msgspec.msgpack.encode(raw)) == Ok(request_id=4, count=0)
    raw = _raw(JobDone(job_id=1, ok=False, failed_keys=[b"k"], nbytes=0, seconds=0.5, error="x"))
    del raw["error"]
    assert decode_reply(msgspec.msgpack.encode(raw)) == JobDone(1, False, [b"k"], 0, 0.5)


def test_fields_from_a_newer_peer_are_ignored() -> None:
    raw = _raw(_hello())
    raw["added_in_v9"] = [1, 2, 3]
    raw["config"]["added_in_v9"] = {"x": 1}
    assert decode_request(msgspec.msgpack.encode(raw)) == _hello()


def test_step_jobs_nest_tagged_stores_and_loads_in_order() -> None:
    jobs: list[Store | Load] = [
        Store(request_id=0, job_id=1, keys=[b"a"], block_ids=[1], reserved=True),
        Load(request_id=0, job_id=2, keys=[b"b"], block_ids=[2], hold="t"),
        Store(request_id=0, job_id=3, keys=[b"c"], block_ids=[3]),
    ]
    raw = _raw(StepJobs(request_id=9, jobs=jobs))
    assert raw["type"] == "step_jobs"
    assert [job["type"] for job in raw["jobs"]] == ["store", "load", "store"]
    assert decode_request(encode(StepJobs(9, jobs))) == StepJobs(9, jobs)
