"""What every request handler of the daemon checks first. Pure: no sockets, no loop.

- ``Refused(code, message)``: raised inside a handler; the daemon answers the request with
  ``Error(code, message)``, counts it, and goes on serving everyone else.
- ``ready_engine(registry, session)``: the session's engine and its namespace, or
  ``ENGINE_NOT_READY`` naming the ranks the engine still waits for.
- ``check_keys(keys, engine, limits)``: at most ``limits.keys_per_request`` keys (default
  ``MAX_KEYS_PER_REQUEST``), none longer than ``limits.key_bytes``, each long enough to hold a
  hash and a 4-byte group, each naming one of the engine's groups. ``keys_pass(keys, engine,
  limits)``: its usual case, all but the count, as a yes or no (a step's keys checked as one);
  ``keys_pass_together(key_lists, engine, limits)``: the same for lists of keys, the count
  included (a step's jobs or holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

from offloadd.server.limits import Limits
from offloadd.server.registry import Engine, Namespace, Registry, Session, group_bytes, group_of_key
from offloadd.settings import LimitsSettings
from protocol.errors import ErrorCode

__all__ = ["MAX_KEYS_PER_REQUEST", "Refused", "check_keys", "keys_pass", "ready_engine"]

MAX_KEYS_PER_REQUEST = LimitsSettings().keys_per_request
_DEFAULT_LIMITS = Limits(LimitsSettings())


class Refused(Exception):
    """A request that gets an Error reply; raised inside handlers."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def ready_engine(registry: Registry, session: Session) -> tuple[Engine, Namespace]:
    """The engine of ``session`` and its namespace; Refused while it waits for ranks."""
    engine = registry.engine(session.engine_key)
    if engine is None or engine.namespace is None:
        missing = engine.missing_ranks() if engine else []
        raise Refused(ErrorCode.ENGINE_NOT_READY, f"engine waits for ranks {missing}")
    return engine, engine.namespace


def check_keys(keys: list[bytes], engine: Engine, limits: Limits | None = None) -> None:
    """Refuse too many or too long keys, and keys that name no group of ``engine``."""
    limits = limits or _DEFAULT_LIMITS
    most = limits.settings.keys_per_request
    if len(keys) > most:
        raise Refused(ErrorCode.TOO_LARGE, f"more than {most} keys (limits.keys_per_request)")
    groups = engine.group_positions
    if keys_pass(keys, engine, limits):
        return  # anything else goes through the precise checks below for its message
    problem = limits.keys_problem(keys)  # the length of each (it is kept in index and journal)
    if problem:
        raise Refused(ErrorCode.TOO_LARGE, problem)
    for key in keys:
        if len(key) < 5:
            raise Refused(
                ErrorCode.BAD_REQUEST, f"key {key.hex()} is shorter than hash + 4-byte group"
            )
        group = group_of_key(key)
        if group not in groups:
            raise Refused(
                ErrorCode.BAD_REQUEST,
                f"key {key.hex()} names group {group}, the engine has groups {sorted(groups)}",
            )


def keys_pass(keys: Sequence[bytes], engine: Engine, limits: Limits) -> bool:
    """The fast pass of ``check_keys`` but for the count, at C speed: every key's length is
    within bounds and it ends with one of the engine's group ids."""
    lengths = list(map(len, keys))
    suffixes = engine.group_suffixes
    return (
        min(lengths, default=5) >= 5
        and max(lengths, default=0) <= limits.settings.key_bytes
        and all(map(suffixes.__contains__, map(group_bytes, keys)))
    )


def keys_pass_together(
    key_lists: Sequence[Sequence[bytes]], engine: Engine, limits: Limits
) -> bool:
    """Whether every list of keys would pass ``check_keys``, checked as one at C speed (a
    step's jobs or holds: hundreds of lists)."""
    most = limits.settings.keys_per_request
    return all(len(keys) <= most for keys in key_lists) and keys_pass(
        list(chain.from_iterable(key_lists)), engine, limits
    )


def check_offloaded(keys: list[bytes], namespace: Namespace) -> None:
    """Every key's group has layers on every rank (else it is not offloaded at all)."""
    offloaded = {
        group.to_bytes(4, "big")
        for group, position in namespace.group_positions.items()
        if 0 <= group < 1 << 32 and 0 not in namespace.shard_sizes[position]
    }
    if min(map(len, keys), default=4) >= 4 and all(
        map(offloaded.__contains__, map(group_bytes, keys))
    ):
        return  # the usual case, at C speed; anything else is checked key by key below
    for key in keys:
        if 0 in namespace.shard_sizes_for_key(key):
            raise Refused(
                ErrorCode.BAD_REQUEST,
                f"group {group_of_key(key)} has no layers on some rank: it is not offloaded",
            )
