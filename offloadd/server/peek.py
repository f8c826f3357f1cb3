"""What a request frame asks for, read without building the request: its tag, its request id,
and for a step message the ids of its nested lookups and how many lookups, jobs and keys it
carries.

A request that needs a session, from a peer without one, is refused ``NOT_REGISTERED``
whatever it holds (``Dispatcher.unregistered``). Decoding such a frame whole first, up to
``server.max_frame_bytes`` of keys (about 100 ms for 16 MiB), would let a peer that never
said Hello spend the event loop's time for nothing. msgspec skips what a struct does not name
without building it, and a key list's length is its msgpack header, so this reads a frame for
a few percent of its decoding. The counts are those ``Limits.message_problem`` bounds, so a
peeked message is refused ``TOO_LARGE`` exactly as the decoded one would be.

- ``peek(frame)``: a ``Peek``, or None when the frame does not read as a request of the shape
  its tag names (the caller decodes it whole and answers what is wrong with it).
- ``step_counts(request)``: the same ``StepCounts`` of a decoded request (None for requests
  that carry no nested lookups or jobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from protocol.messages import Request, Reserve, StepJobs, UpdateHolds

__all__ = ["Peek", "StepCounts", "peek", "step_counts"]


@dataclass(frozen=True, slots=True)
class StepCounts:
    """A step message's size: nested lookups, jobs (StepJobs) and keys in all its lists."""

    lookups: int = 0
    jobs: int = 0
    keys: int = 0


@dataclass(frozen=True, slots=True)
class Peek:
    """A frame's tag and request id; a step message's nested lookup ids and counts."""

    type: str
    request_id: int
    nested: list[int]
    counts: StepCounts | None


class _Kind(msgspec.Struct):
    type: str = ""
    request_id: int = 0


class _Keyed(msgspec.Struct):
    """A nested Lookup or a job: its id and its keys, not read."""

    keys: msgspec.Raw
    request_id: int = 0


class _Held(msgspec.Struct, array_like=True):
    token: msgspec.Raw
    keys: msgspec.Raw


_NONE = msgspec.Raw(b"\x90")  # an empty msgpack array


class _Reserve(msgspec.Struct):
    keys: msgspec.Raw
    holds: list[_Held] = []
    release: list[_Held] = []
    lookups: list[_Keyed] = []
    touch: msgspec.Raw = _NONE


class _Holds(msgspec.Struct):
    hold: list[_Held] = []
    release: list[_Held] = []
    lookups: list[_Keyed] = []
    touch: msgspec.Raw = _NONE


class _Jobs(msgspec.Struct):
    jobs: list[_Keyed] = []


_kind = msgspec.msgpack.Decoder(_Kind)
_steps: dict[str, msgspec.msgpack.Decoder[_Reserve] | msgspec.msgpack.Decoder[_Holds]] = {
    "reserve": msgspec.msgpack.Decoder(_Reserve),
    "holds": msgspec.msgpack.Decoder(_Holds),
}
_jobs = msgspec.msgpack.Decoder(_Jobs)


class _NotAList(Exception):
    pass


def _length(raw: msgspec.Raw) -> int:
    """The length of the msgpack array ``raw`` (its header), without reading its items."""
    view = memoryview(raw)
    head = view[0] if view else 0
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(view) >= 3:
        return int.from_bytes(view[1:3], "big")
    if head == 0xDD and len(view) >= 5:
        return int.from_bytes(view[1:5], "big")
    raise _NotAList


def _held(lists: list[_Held]) -> int:
    return sum(_length(held.keys) for held in lists)


def peek(frame: bytes) -> Peek | None:
    """``frame``'s tag, id and step counts; None when it does not read as a request."""
    try:
        kind = _kind.decode(frame)
        step = _steps.get(kind.type)
        if step is not None:
            message = step.decode(frame)
            lookups = message.lookups
            keys = sum(_length(lookup.keys) for lookup in lookups) + _length(message.touch)
            keys += _held(message.release)
            if isinstance(message, _Reserve):
                keys += _length(message.keys) + _held(message.holds)
            else:
                keys += _held(message.hold)
            nested = [lookup.request_id for lookup in lookups]
            return Peek(kind.type, kind.request_id, nested, StepCounts(len(lookups), 0, keys))
        if kind.type == "step_jobs":
            jobs = _jobs.decode(frame).jobs
            counts = StepCounts(0, len(jobs), sum(_length(job.keys) for job in jobs))
            return Peek(kind.type, kind.request_id, [], counts)
    except (msgspec.DecodeError, msgspec.ValidationError, _NotAList, RecursionError):
        return None
    return Peek(kind.type, kind.request_id, [], None)


def step_counts(request: Request) -> StepCounts | None:
    """A decoded request's ``StepCounts`` (None when it carries no lookups or jobs)."""
    if isinstance(request, Reserve | UpdateHolds):
        lookups = request.lookups
        keys = sum(len(lookup.keys) for lookup in lookups) + len(request.touch)
        keys += sum(len(held.keys) for held in request.release)
        if isinstance(request, Reserve):
            keys += len(request.keys) + sum(len(held.keys) for held in request.holds)
        else:
            keys += sum(len(held.keys) for held in request.hold)
        return StepCounts(len(lookups), 0, keys)
    if isinstance(request, StepJobs):
        return StepCounts(0, len(request.jobs), sum(len(job.keys) for job in request.jobs))
    return None
