"""The cached keys a scheduler's requests use without loading them, for the daemon's recency.

A request's prefix comes from its engine's GPU prefix cache first, and only the rest is
looked up in the offload cache and loaded; a load refreshes a key's recency in the daemon, a
GPU hit does not. Alone, that is harmless: the engine does not need what its GPU holds. But
engines share the daemon's cache, and a prefix one engine keeps serving from its GPU ages
out of the arena while another engine needs it next (2 DP engines on the Mooncake trace:
0.955-0.967 of an exact LRU without this). vLLM's contract has ``touch()`` for exactly
this, but vLLM 0.33 never calls it and passes no list of GPU hits; the keys of a request's
prompt are in its ``ReqContext`` (``_offload_key_positions``, filled by the scheduler's
``update_offload_keys`` before its first lookup). So when a request is first scheduled,
every key of it the cache holds is touched, with the step's message, as an exact LRU counts
a use. Pure logic: no vLLM import, no sockets.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable
from typing import Any

__all__ = ["PrefixUse"]

# A message carries at most this many keys to touch (far under limits.keys_per_request);
# beyond, the oldest are dropped: recency is a hint, not a promise.
MAX_TOUCHED = 1 << 14


class PrefixUse:
    """Requests waiting for their first schedule, and the keys to touch in the next message."""

    def __init__(self) -> None:
        self._requests: dict[str, Any] = {}  # request id -> vLLM's ReqContext
        self._touch: list[bytes] = []

    def started(self, req_id: str, req_context: Any) -> None:
        self._requests[req_id] = req_context

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def scheduled(self, req_ids: Iterable[str], cached: Container[bytes]) -> None:
        """The requests were scheduled for the first time: touch their keys in ``cached``."""
        for req_id in req_ids:
            req_context = self._requests.pop(req_id, None)
            keys: Collection[bytes] = getattr(req_context, "_offload_key_positions", ())
            self._touch.extend(key for key in keys if key in cached)
        if len(self._touch) > MAX_TOUCHED:
            del self._touch[:-MAX_TOUCHED]

    def take(self) -> list[bytes]:
        touch, self._touch = self._touch, []
        return touch
