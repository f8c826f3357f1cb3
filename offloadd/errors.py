"""The client's error tree. "The daemon is gone" is not "this request failed".

OffloaddError
├── DaemonUnavailable      no answer (daemon down, wrong endpoint, timeout)
├── RequestFailed          the daemon answered Error(code, message)
│   ├── ConfigMismatch     Hello disagrees with the engine (names the field)
│   ├── InvalidRequest     bad geometry, block ids, lengths, roles, versions
│   ├── NotReady           the engine still waits for ranks
│   └── NotPermitted       no valid registration, or another user's engine or session
└── JobError               a job finished with ok=False, or did not finish in time
"""

from __future__ import annotations

from protocol.errors import ErrorCode
from protocol.messages import Error, JobDone


class OffloaddError(Exception):
    """Root of every error the client raises."""


class DaemonUnavailable(OffloaddError):
    """The daemon did not answer: it is not running, or the endpoint is wrong, or it hung."""


class RequestFailed(OffloaddError):
    """The daemon refused a request; ``code`` and ``message`` are what it said."""

    def __init__(self, code: int, message: str, request_id: int = 0) -> None:
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"code {code}"
        super().__init__(f"{name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ConfigMismatch(RequestFailed):
    """This rank's config disagrees with its engine's."""


class InvalidRequest(RequestFailed):
    """The request was malformed or inconsistent with the registered tensors."""


class NotReady(RequestFailed):
    """The engine is still waiting for some of its ranks."""


class NotPermitted(RequestFailed):
    """The daemon does not know who sent this (no valid registration), or the sender's user
    may not touch what it named (another user's engine or session)."""


class JobError(OffloaddError):
    """A store or load did not complete successfully (``results`` holds what came back)."""

    def __init__(self, message: str, results: list[JobDone] | None = None) -> None:
        super().__init__(message)
        self.results = results or []


_BY_CODE: dict[int, type[RequestFailed]] = {
    ErrorCode.CONFIG_MISMATCH: ConfigMismatch,
    ErrorCode.ENGINE_NOT_READY: NotReady,
    ErrorCode.MALFORMED: InvalidRequest,
    ErrorCode.UNSUPPORTED_VERSION: InvalidRequest,
    ErrorCode.BAD_GEOMETRY: InvalidRequest,
    ErrorCode.BAD_REQUEST: InvalidRequest,
    ErrorCode.DUPLICATE_JOB: InvalidRequest,
    ErrorCode.WRONG_ROLE: InvalidRequest,
    ErrorCode.TOO_LARGE: InvalidRequest,
    ErrorCode.HANDLE_OPEN_FAILED: InvalidRequest,
    ErrorCode.UNAUTHENTICATED: NotPermitted,
    ErrorCode.NOT_PERMITTED: NotPermitted,
}


def error_from_reply(reply: Error) -> RequestFailed:
    """The exception that matches an Error reply's code."""
    cls = _BY_CODE.get(reply.code, RequestFailed)
    return cls(reply.code, reply.message, reply.request_id)
