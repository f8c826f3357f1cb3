"""What a request frame asks for, read without building the request: its tag, its request id,
and for a step message how many lookups, jobs and keys it carries.

A request that needs a session, from a peer without one, is refused ``NOT_REGISTERED``
whatever it holds (``Dispatcher.unregistered``). Decoding such a frame whole first, up to
``server.max_frame_bytes`` of keys (about 100 ms for 16 MiB), would let a peer that never
said Hello spend the event loop's time for nothing. msgspec skips what a struct does not name
without building it, and a list's length is its msgpack header, so this reads a frame for a
few percent of its decoding. The counts are those ``Limits.message_problem`` bounds, so a
peeked message is refused ``TOO_LARGE`` as the decoded one would be; its keys are counted
(one pass over its lookups or jobs) only when the frame is long enough to hold more keys than
the bound.

- ``peek(frame)``: a ``Peek``, or None when the frame does not read as a request (the caller
  decodes it whole and answers what is wrong with it).
- ``Peek.counts(keys)``: its ``StepCounts`` (None for a request that is no step message).
- ``step_counts(request)``: the same ``StepCounts`` of a decoded request.
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


class _Kind(msgspec.Struct, gc=False):
    type: str = ""
    request_id: int = 0


_NONE = msgspec.Raw(b"\x90")  # an empty msgpack array


class _Lists(msgspec.Struct, gc=False):
    """A step message's lists of lookups and jobs, not read."""

    lookups: msgspec.Raw = _NONE
    jobs: msgspec.Raw = _NONE


class _Keyed(msgspec.Struct, gc=False):
    """A nested Lookup or a job: its keys, not read."""

    keys: msgspec.Raw


class _Held(msgspec.Struct, array_like=True, gc=False):
    token: msgspec.Raw
    keys: msgspec.Raw


class _Reserve(msgspec.Struct, gc=False):
    keys: msgspec.Raw
    holds: list[_Held] = []
    release: list[_Held] = []
    lookups: list[_Keyed] = []
    touch: msgspec.Raw = _NONE


class _Holds(msgspec.Struct, gc=False):
    hold: list[_Held] = []
    release: list[_Held] = []
    lookups: list[_Keyed] = []
    touch: msgspec.Raw = _NONE


class _Jobs(msgspec.Struct, gc=False):
    jobs: list[_Keyed] = []


_kind = msgspec.msgpack.Decoder(_Kind)
_lists = msgspec.msgpack.Decoder(_Lists)
_steps: dict[str, msgspec.msgpack.Decoder[_Reserve] | msgspec.msgpack.Decoder[_Holds]] = {
    "reserve": msgspec.msgpack.Decoder(_Reserve),
    "holds": msgspec.msgpack.Decoder(_Holds),
}
_jobs = msgspec.msgpack.Decoder(_Jobs)
STEPS = frozenset({"reserve", "holds", "step_jobs"})


class _NotAList(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Peek:
    """A frame's tag and request id; for a step message its lookups and jobs, counted from
    their lists' headers. ``counts(keys)`` counts its keys too when asked (a pass over its
    lookups or jobs, not over their keys)."""

    type: str
    request_id: int
    frame: bytes
    lookups: int = 0
    jobs: int = 0

    def counts(self, keys: bool) -> StepCounts | None:
        """The step message's counts (None for other requests); its keys counted only when
        ``keys``, else 0 (and 0 too when its lists do not read as they should)."""
        if self.type not in STEPS:
            return None
        return StepCounts(self.lookups, self.jobs, self._keys() if keys else 0)

    def _keys(self) -> int:
        try:
            step = _steps.get(self.type)
            if step is None:
                return sum(_length(job.keys) for job in _jobs.decode(self.frame).jobs)
            message = step.decode(self.frame)
            keys = sum(_length(lookup.keys) for lookup in message.lookups)
            keys += _length(message.touch) + _held(message.release)
            if isinstance(message, _Reserve):
                return keys + _length(message.keys) + _held(message.holds)
            return keys + _held(message.hold)
        except (msgspec.DecodeError, msgspec.ValidationError, _NotAList, RecursionError):
            return 0


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
    """``frame``'s tag and id, and a step message's list lengths; None when it does not read
    as a request (its lists not lists included)."""
    try:
        kind = _kind.decode(frame)
        if kind.type not in STEPS:
            return Peek(kind.type, kind.request_id, frame)
        lists = _lists.decode(frame)
        if kind.type == "step_jobs":
            return Peek(kind.type, kind.request_id, frame, jobs=_length(lists.jobs))
        return Peek(kind.type, kind.request_id, frame, lookups=_length(lists.lookups))
    except (msgspec.DecodeError, msgspec.ValidationError, _NotAList, RecursionError):
        return None


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
