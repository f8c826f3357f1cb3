"""Error codes on the wire. Integers are written out and never reused (append only)."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Why the daemon refused a request; carried by ``protocol.messages.Error``."""

    MALFORMED = 1  # undecodable frame, unknown tag, wrong field type
    UNSUPPORTED_VERSION = 2  # protocol_version the daemon cannot speak
    NOT_REGISTERED = 3  # request before a successful Hello
    CONFIG_MISMATCH = 4  # Hello disagrees with the engine's config
    BAD_GEOMETRY = 5  # KV regions inconsistent with themselves or the config
    BAD_REQUEST = 6  # well-formed but invalid (block id out of range, length mismatch, ...)
    ENGINE_NOT_READY = 7  # engine still waiting for ranks
    HANDLE_OPEN_FAILED = 8  # a memory handle could not be opened
    DUPLICATE_JOB = 9  # job_id already in flight for this session
    WRONG_ROLE = 10  # e.g. a scheduler asking to store
    SHUTTING_DOWN = 11  # daemon is draining and takes no new jobs
    INTERNAL = 12  # a bug in the daemon; it keeps serving
    TOO_LARGE = 13  # frame or request above the daemon's limits
    UNAUTHENTICATED = 14  # Hello without a valid registration token (see protocol.peer)
    NOT_PERMITTED = 15  # the peer's user may not do this (another user's engine or session)
    DEADLINE_PASSED = 16  # a Store's deadline (the rank's clock) passed before it started
