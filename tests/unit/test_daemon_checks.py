"""offloadd.server.checks and the sessions' liveness decisions (offloadd.server.state): pure,
no sockets."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from offloadd.server.checks import (
    MAX_KEYS_PER_REQUEST,
    Refused,
    check_keys,
    check_offloaded,
    ready_engine,
)
from offloadd.server.registry import Namespace, Registry
from offloadd.server.sessions import close_on
from offloadd.server.state import SessionState, silent_sessions
from protocol.errors import ErrorCode
from tests.helpers import hello, register_engine


def key(group: int, hash_: bytes = b"h" * 8) -> bytes:
    return hash_ + group.to_bytes(4, "big")


def test_a_ready_engine_gives_its_namespace_and_a_waiting_one_names_its_missing_ranks() -> None:
    registry = Registry()
    first = registry.hello("s0", hello(rank=0, world_size=3))
    with pytest.raises(Refused) as refused:
        ready_engine(registry, first.session)
    assert refused.value.code == ErrorCode.ENGINE_NOT_READY
    assert "[1, 2]" in str(refused.value)
    registry.hello("s1", hello(rank=1, world_size=3))
    last = registry.hello("s2", hello(rank=2, world_size=3))
    engine, namespace = ready_engine(registry, last.session)
    assert engine is last.engine and namespace is engine.namespace


def test_keys_must_be_few_long_enough_and_name_a_group_of_the_engine() -> None:
    registry = Registry()
    engine = register_engine(registry)[-1].engine
    check_keys([key(0), key(0, b"other")], engine)  # one group (0): fine
    cases: list[tuple[list[bytes], ErrorCode, str]] = [
        ([b"\x00\x00\x00\x00"], ErrorCode.BAD_REQUEST, "shorter than hash + 4-byte group"),
        ([key(0), key(7)], ErrorCode.BAD_REQUEST, "names group 7, the engine has groups [0]"),
        ([key(0)] * (MAX_KEYS_PER_REQUEST + 1), ErrorCode.TOO_LARGE, "more than 65536 keys"),
    ]
    for keys, code, message in cases:
        with pytest.raises(Refused, match=re.escape(message)) as refused:
            check_keys(keys, engine)
        assert refused.value.code == code


def states(*seen: tuple[float, int | None, bool]) -> list[SessionState]:
    """Sessions with (last_seen, pidfd, alive)."""
    session = register_engine(Registry())[0].session
    made = []
    for last_seen, pidfd, alive in seen:
        state = SessionState(b"id", session, [], last_seen=last_seen, pidfd=pidfd)
        state.alive = alive
        made.append(state)
    return made


def test_the_reaper_ends_only_live_unwatched_sessions_silent_for_the_timeout() -> None:
    silent, recent, watched, ended, edge = states(
        (60.0, None, True),  # silent 40 s of a 30 s timeout
        (95.0, None, True),  # spoke 5 s ago
        (10.0, 7, True),  # silent, but its pidfd says when its process exits
        (10.0, None, False),  # already ended
        (70.0, None, True),  # silent exactly the timeout: not yet
    )
    chosen = silent_sessions([silent, recent, watched, ended, edge], now=100.0, timeout=30.0)
    assert chosen == [silent]
    assert silent_sessions([recent, edge], now=100.01, timeout=30.0) == [edge]


def test_import_closes_run_on_the_import_thread_or_inline_once_it_is_shut_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    threads: list[str] = []

    def close() -> None:
        threads.append(threading.current_thread().name)

    importer = ThreadPoolExecutor(1, thread_name_prefix="test-ipc")
    closer: Callable[[Callable[[], None]], None] = close_on(importer)
    closer(close)
    importer.shutdown(wait=True)
    assert threads == ["test-ipc_0"]
    closer(close)  # after shutdown: inline, on this thread
    assert threads[-1] == threading.current_thread().name

    def broken() -> None:
        raise OSError("stream gone")

    with caplog.at_level(logging.ERROR, logger="offloadd.server"):
        closer(broken)  # logged, never raised into the handle table
    assert "closing a CUDA IPC import failed" in caplog.text


def test_chunk_bytes_and_the_offloaded_check_read_each_key_s_group() -> None:
    # Groups 3 and 9; group 9 has no layers on the second rank (a size of 0 there).
    namespace = Namespace("ns", 1, [(10, 20), (30, 0)], False, {3: 0, 9: 1})
    keys = [key(3), key(9), key(3, b"other"), key(9), key(3)]
    assert namespace.chunk_bytes(keys) == [30, 30, 30, 30, 30]
    assert namespace.chunk_bytes(keys[:2]) == [30, 30]
    with pytest.raises(KeyError):
        namespace.chunk_bytes([*keys, key(4)])  # a group the namespace lacks, as before
    check_offloaded([key(3)] * 5, namespace)
    with pytest.raises(Refused, match="group 9 has no layers on some rank") as refused:
        check_offloaded([key(3), key(3), key(3), key(9)], namespace)
    assert refused.value.code == ErrorCode.BAD_REQUEST
