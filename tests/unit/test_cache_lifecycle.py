"""The entry lifecycle table: every move against an oracle, and the moves a real cache makes."""

from __future__ import annotations

from collections.abc import Container

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from offloadd.cache import lifecycle
from offloadd.cache.index import ChunkCache, Reads, RestoredChunk, ShardWrite
from offloadd.cache.lifecycle import MARKS, PHASES, Event, IllegalTransition, Mark, Phase

E, P = Event, Phase
A = 4096

# The oracle, written apart from the module's tables: which marks each phase keeps, where
# each mark may be taken, and the phase moves.
KEEPS: dict[Phase, set[Mark]] = {
    P.FREE: set(),
    P.PENDING: {Mark.RESERVED, Mark.WRITING},
    P.DEAD: {Mark.WRITING},
    P.COMMITTED: {Mark.READING, Mark.HELD, Mark.PINNED},
    P.LEAVING: {Mark.READING, Mark.HELD},
    P.REMOVED: {Mark.READING, Mark.HELD},
}
TAKES: dict[Event, tuple[Mark, set[Phase]]] = {
    E.RESERVE: (Mark.RESERVED, {P.PENDING}),
    E.START_WRITE: (Mark.WRITING, {P.PENDING}),
    E.START_READ: (Mark.READING, {P.COMMITTED, P.LEAVING, P.REMOVED}),
    E.HOLD: (Mark.HELD, {P.COMMITTED, P.LEAVING}),
    E.PIN: (Mark.PINNED, {P.COMMITTED}),
}
DROPS: dict[Event, Mark] = {
    E.UNRESERVE: Mark.RESERVED,
    E.STOP_WRITE: Mark.WRITING,
    E.STOP_READ: Mark.READING,
    E.UNHOLD: Mark.HELD,
    E.UNPIN: Mark.PINNED,
}
MOVES: dict[tuple[Phase, Event], Phase] = {
    (P.FREE, E.ALLOCATE): P.PENDING,
    (P.PENDING, E.COMMIT): P.COMMITTED,
    (P.PENDING, E.UNLINK): P.DEAD,
    (P.COMMITTED, E.UNLINK): P.REMOVED,
    (P.COMMITTED, E.UNLINK_WATCHED): P.LEAVING,
    (P.LEAVING, E.ACK): P.REMOVED,
    (P.DEAD, E.RELEASE): P.FREE,
    (P.REMOVED, E.RELEASE): P.FREE,
}
BITS = {
    P.FREE: 0,
    P.PENDING: 0,
    P.COMMITTED: lifecycle.COMMITTED,
    P.DEAD: lifecycle.DEAD,
    P.REMOVED: lifecycle.COMMITTED | lifecycle.DEAD,
    P.LEAVING: lifecycle.COMMITTED | lifecycle.DEAD | lifecycle.LEAVING,
}
ALL_MARKS = [Mark.WRITING, Mark.READING, Mark.HELD, Mark.PINNED, Mark.RESERVED]


def states() -> list[tuple[int, Phase, set[Mark]]]:
    """Every legal state byte, its phase and marks (by the oracle)."""
    out: list[tuple[int, Phase, set[Mark]]] = []
    for phase, keeps in KEEPS.items():
        if phase is P.FREE:
            continue
        for n in range(1 << len(ALL_MARKS)):
            marks = {mark for i, mark in enumerate(ALL_MARKS) if n >> i & 1}
            if marks <= keeps:
                out.append((BITS[phase] | sum(marks), phase, marks))
    return out


def expected(state: int, phase: Phase, marks: set[Mark], event: Event) -> int | None:
    """The oracle's next state, or None for an illegal move."""
    if event in TAKES:
        mark, phases = TAKES[event]
        return state | mark if phase in phases else None
    if event in DROPS:
        return state & ~int(DROPS[event]) if DROPS[event] in marks else None
    source = P.FREE if event is E.ALLOCATE else phase
    if event is E.ALLOCATE and state != 0:
        return None
    target = MOVES.get((source, event))
    if target is None or not marks <= KEEPS[target]:
        return None
    return BITS[target] | sum(marks)


LEGAL = states()


def test_the_oracle_and_the_module_agree_on_the_states() -> None:
    assert len(LEGAL) == 22
    for state in range(256):
        decoded = lifecycle.decode(state)
        match = [(phase, marks) for s, phase, marks in LEGAL if s == state]
        if not match:
            assert decoded is None, state
        else:
            ((phase, marks),) = match
            assert decoded == (phase, Mark(sum(marks)))
    assert lifecycle.describe(0) == "PENDING"
    assert lifecycle.describe(lifecycle.COMMITTED | lifecycle.HELD | lifecycle.READING) == (
        "COMMITTED+READING+HELD"
    )
    assert lifecycle.describe(lifecycle.DEAD | lifecycle.PINNED).startswith("no legal state")


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_each_legal_move_is_allowed_and_each_illegal_one_raises(event: Event) -> None:
    allowed = lifecycle.allowed(event)
    legal_states = {s for s, _, _ in LEGAL}
    for state, phase, marks in LEGAL:
        nxt = expected(state, phase, marks, event)
        if nxt is None:
            assert not allowed[state]
            with pytest.raises(IllegalTransition) as err:
                lifecycle.step(state, event)
            assert err.value.state == state and err.value.event is event
            assert event.name in str(err.value) and lifecycle.describe(state) in str(err.value)
        else:
            assert allowed[state]
            assert lifecycle.step(state, event) == nxt
            assert nxt in legal_states  # a legal move never leaves the table's states
    for state in set(range(256)) - legal_states:  # nothing moves from a state not in the table
        assert not allowed[state]
        with pytest.raises(IllegalTransition):
            lifecycle.step(state, event)


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (lifecycle.WRITING, E.COMMIT),  # a shard is still being written
        (lifecycle.RESERVED, E.COMMIT),  # the reservation ends first
        (lifecycle.RESERVED, E.UNLINK),
        (lifecycle.COMMITTED | lifecycle.PINNED, E.UNLINK),  # pins are dropped first
        (lifecycle.COMMITTED | lifecycle.PINNED, E.UNLINK_WATCHED),
        (lifecycle.COMMITTED, E.RELEASE),  # a visible entry is never freed
        (lifecycle.DEAD | lifecycle.WRITING, E.RELEASE),  # its copy still uses the extent
        (lifecycle.COMMITTED | lifecycle.DEAD | lifecycle.HELD, E.RELEASE),
        (lifecycle.COMMITTED | lifecycle.DEAD | lifecycle.LEAVING, E.RELEASE),
        (lifecycle.COMMITTED, E.START_WRITE),
        (lifecycle.COMMITTED, E.RESERVE),
        (0, E.START_READ),  # pending entries are never read
        (lifecycle.COMMITTED | lifecycle.DEAD, E.PIN),
        (lifecycle.COMMITTED | lifecycle.DEAD, E.HOLD),  # only while a watcher may show it
        (lifecycle.DEAD, E.COMMIT),  # a dead entry never becomes visible
        (lifecycle.COMMITTED, E.COMMIT),
        (lifecycle.COMMITTED, E.ACK),
        (lifecycle.COMMITTED, E.UNHOLD),
        (lifecycle.COMMITTED, E.ALLOCATE),
    ],
)
def test_named_illegal_moves(state: int, event: Event) -> None:
    with pytest.raises(IllegalTransition, match=f"illegal lifecycle move: {event.name} from"):
        lifecycle.step(state, event)


def test_dropping_a_mark_keeps_the_phase_and_the_other_marks() -> None:
    leaving = lifecycle.COMMITTED | lifecycle.DEAD | lifecycle.LEAVING
    assert lifecycle.step(leaving | lifecycle.READING | lifecycle.HELD, E.STOP_READ) == (
        leaving | lifecycle.HELD
    )
    assert lifecycle.step(lifecycle.DEAD | lifecycle.WRITING, E.STOP_WRITE) == lifecycle.DEAD


def test_step_all_moves_an_array_or_raises_for_any_illegal_state() -> None:
    states_ = np.array([0, 0, lifecycle.WRITING], np.uint8)
    with pytest.raises(IllegalTransition) as err:
        lifecycle.step_all(states_, E.COMMIT)
    assert err.value.state == lifecycle.WRITING
    assert list(lifecycle.step_all(states_[:2], E.COMMIT)) == [lifecycle.COMMITTED] * 2


def test_record_logs_moves_and_stops_afterwards() -> None:
    with lifecycle.record() as moves:
        lifecycle.step(0, E.START_WRITE)
        lifecycle.step_all(np.zeros(2, np.uint8), E.COMMIT)
    lifecycle.step(0, E.COMMIT)
    assert moves == [
        (0, E.START_WRITE, lifecycle.WRITING),
        (0, E.COMMIT, lifecycle.COMMITTED),
        (0, E.COMMIT, lifecycle.COMMITTED),
    ]


def test_the_module_tables_are_the_oracle_s() -> None:
    assert {
        (phase, event): target for phase, moves in PHASES.items() for event, target in moves.items()
    } == MOVES
    for mark, (take, drop, taken_in, kept_in) in MARKS.items():
        assert TAKES[take] == (mark, set(taken_in)) and DROPS[drop] == mark
        assert {phase for phase, keeps in KEEPS.items() if mark in keeps} == kept_in


def test_a_restore_commits_its_rows_through_the_table() -> None:
    cache = ChunkCache(4 * A)
    with lifecycle.record() as moves:
        cache.restore(
            [RestoredChunk("ns", b"k", (0,), (A,)), RestoredChunk("ns", b"j", (A,), (A,))]
        )
    assert [event for _, event, _ in moves] == [E.ALLOCATE, E.ALLOCATE, E.COMMIT, E.COMMIT]
    assert cache.keys_in("ns") == [b"k", b"j"]


# -- the moves of a real cache -----------------------------------------------------------------

NS_SIZES: dict[str, tuple[int, ...]] = {"a": (A,), "b": (A, A)}
NAMESPACES = sorted(NS_SIZES)
KEYS = [bytes([i]) for i in range(4)]
OWNERS = ["o1", "o2"]
TOKENS = ["t1", "t2"]
CAP = 16 * A  # room for every key of both namespaces: stores commit rather than refuse
keys_st = st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=3)

# (phase, event) pairs the machines performed, and the phases seen, over every example.
PERFORMED: set[tuple[Phase, Event]] = set()
SEEN: set[Phase] = set()


def move_of(state: int, event: Event, nxt: int) -> tuple[Phase, Event, Phase]:
    before, after = lifecycle.decode(state), lifecycle.decode(nxt)
    assert before is not None and after is not None
    source = P.FREE if event is E.ALLOCATE else before[0]
    target = P.FREE if event is E.RELEASE else after[0]
    return source, event, target


class LifecycleMachine(RuleBasedStateMachine):
    """Random operations on a small cache with watchers; every move it makes is the oracle's."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.cache = ChunkCache(CAP, clock=lambda: self.now)
        self._recording = lifecycle.record()
        self.moves = self._recording.__enter__()
        self.stores: list[list[ShardWrite]] = []
        self.loads: list[Reads] = []
        self.held: dict[tuple[str, str], set[bytes]] = {}  # keys held at some point

    def teardown(self) -> None:
        self._recording.__exit__(None, None, None)

    @initialize(both=st.booleans())
    def start(self, both: bool) -> None:
        """Runs start watched, so that removed entries are often leaving."""
        for ns in NAMESPACES if both else NAMESPACES[:1]:
            self.watch(ns)

    def committed(self, ns: str) -> list[bytes]:
        """The committed keys of ``ns``, storing some first if there are none."""
        if not self.cache.keys_in(ns):
            self.store_every_shard(ns, KEYS[:2])
        return self.cache.keys_in(ns)

    @rule(ns=st.sampled_from(NAMESPACES), keys=keys_st, owner=st.sampled_from(OWNERS))
    def reserve(self, ns: str, keys: list[bytes], owner: str) -> None:
        self.cache.reserve(ns, keys, owner, lambda _: NS_SIZES[ns])

    @rule(owner=st.sampled_from(OWNERS))
    def release_reservations(self, owner: str) -> None:
        self.cache.release_reservations(owner)

    @rule(ns=st.sampled_from(NAMESPACES), keys=keys_st, data=st.data(), allocate=st.booleans())
    def begin_store(self, ns: str, keys: list[bytes], data: st.DataObject, allocate: bool) -> None:
        shard = data.draw(st.integers(0, len(NS_SIZES[ns]) - 1))
        res = self.cache.begin_store(ns, keys, shard, lambda _: NS_SIZES[ns], allocate=allocate)
        if res.writes:
            self.stores.append(res.writes)

    @rule(ns=st.sampled_from(NAMESPACES), keys=keys_st)
    def store_every_shard(self, ns: str, keys: list[bytes]) -> None:
        for shard in range(len(NS_SIZES[ns])):
            res = self.cache.begin_store(ns, keys, shard, lambda _: NS_SIZES[ns])
            self.cache.finish_store(res.writes, ok=True)

    @precondition(lambda self: bool(self.stores))
    @rule(data=st.data(), ok=st.booleans())
    def finish_store(self, data: st.DataObject, ok: bool) -> None:
        writes = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        self.cache.finish_store(writes, ok)

    @precondition(lambda self: bool(self.stores))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        self.cache.abandon(self.stores[data.draw(st.integers(0, len(self.stores) - 1))])

    @rule(
        ns=st.sampled_from(NAMESPACES),
        keys=keys_st,
        owner=st.sampled_from(OWNERS),
        lease=st.sampled_from([0.0, 5.0]),
    )
    def lookup(self, ns: str, keys: list[bytes], owner: str, lease: float) -> None:
        self.cache.lookup(ns, keys, pin_owner=owner, lease=lease)

    @rule(ns=st.sampled_from(NAMESPACES), owner=st.sampled_from(OWNERS), data=st.data())
    def lookup_committed(self, ns: str, owner: str, data: st.DataObject) -> None:
        """Lookups that hit, so that pins are common."""
        committed = self.committed(ns)
        if committed:
            keys = data.draw(st.lists(st.sampled_from(committed), min_size=1, unique=True))
            self.cache.lookup(ns, keys, pin_owner=owner, lease=5.0)

    @rule(ns=st.sampled_from(NAMESPACES), keys=keys_st, owner=st.sampled_from(OWNERS))
    def release(self, ns: str, keys: list[bytes], owner: str) -> None:
        self.cache.release(ns, keys, owner)

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner: str) -> None:
        self.cache.release_owner(owner)

    @rule(
        ns=st.sampled_from(NAMESPACES),
        owner=st.sampled_from(OWNERS),
        token=st.sampled_from(TOKENS),
        keys=keys_st,
    )
    def hold(self, ns: str, owner: str, token: str, keys: list[bytes]) -> None:
        missing = self.cache.hold(ns, owner, token, keys)
        held = set(keys) - set(missing)
        if held:
            self.held.setdefault((owner, token), set()).update(held)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), load=st.booleans())
    def use_held(self, data: st.DataObject, load: bool) -> None:
        """Loads and releases of keys held before (perhaps removed since)."""
        owner, token = data.draw(st.sampled_from(sorted(self.held)))
        keys = sorted(self.held[(owner, token)])
        keys = data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))
        if load:
            self.begin_load_held(owner, token, keys)
        else:
            self.cache.release_hold(owner, token, keys)

    @rule(owner=st.sampled_from(OWNERS), token=st.sampled_from(TOKENS), keys=keys_st)
    def release_hold(self, owner: str, token: str, keys: list[bytes]) -> None:
        self.cache.release_hold(owner, token, keys)

    @rule(owner=st.sampled_from(OWNERS))
    def release_holds(self, owner: str) -> None:
        self.cache.release_holds(owner)

    @rule(ns=st.sampled_from(NAMESPACES), keys=keys_st)
    def begin_load(self, ns: str, keys: list[bytes]) -> None:
        res = self.cache.begin_reads(ns, keys)
        if res.rows:
            self.loads.append(res)

    @rule(owner=st.sampled_from(OWNERS), token=st.sampled_from(TOKENS), keys=keys_st)
    def begin_load_held(self, owner: str, token: str, keys: list[bytes]) -> None:
        res = self.cache.begin_reads_held(owner, [(token, keys)])[0]
        if res.rows:
            self.loads.append(res)

    @rule(ns=st.sampled_from(NAMESPACES), data=st.data())
    def load_committed(self, ns: str, data: st.DataObject) -> None:
        """Loads of keys that are there, so that reads are common."""
        committed = self.committed(ns)
        if committed:
            self.begin_load(ns, data.draw(st.lists(st.sampled_from(committed), min_size=1)))

    @rule(
        ns=st.sampled_from(NAMESPACES),
        owner=st.sampled_from(OWNERS),
        token=st.sampled_from(TOKENS),
        data=st.data(),
    )
    def hold_committed(self, ns: str, owner: str, token: str, data: st.DataObject) -> None:
        """Holds of keys that are there, then perhaps their removal, a load and a release,
        so that held entries are often read or released after they left the index."""
        committed = self.committed(ns)
        if committed:
            keys = data.draw(st.lists(st.sampled_from(committed), min_size=1, unique=True))
            self.hold(ns, owner, token, keys)
            if data.draw(st.booleans()):
                self.cache.remove(ns, keys)
            if data.draw(st.booleans()):
                self.begin_load_held(owner, token, keys)
            if data.draw(st.booleans()):
                self.cache.release_hold(owner, token, keys)

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        self.cache.finish_reads([self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))])

    @rule(ns=st.sampled_from(NAMESPACES), keys=keys_st)
    def remove(self, ns: str, keys: list[bytes]) -> None:
        self.cache.remove(ns, keys)

    @rule(ns=st.sampled_from(NAMESPACES), acker=st.sampled_from([None, "wa"]))
    def clear_namespace(self, ns: str, acker: str | None) -> None:
        self.cache.clear_namespace(ns, acker=acker)

    @rule(ns=st.sampled_from(NAMESPACES))
    def watch(self, ns: str) -> None:
        self.cache.watch(ns, "w" + ns)

    @rule(ns=st.sampled_from(NAMESPACES))
    def ack(self, ns: str) -> None:
        self.cache.ack("w" + ns, self.cache.seq)

    @rule(ns=st.sampled_from(NAMESPACES))
    def unwatch(self, ns: str) -> None:
        self.cache.unwatch("w" + ns)

    @rule()
    def advance(self) -> None:
        self.now += 3.0

    @invariant()
    def every_move_is_the_oracle_s(self) -> None:
        for state, event, nxt in self.moves:
            decoded = lifecycle.decode(state)
            assert decoded is not None
            assert expected(state, decoded[0], set(decoded[1]), event) == nxt
            source, _, target = move_of(state, event, nxt)
            PERFORMED.add((source, event))
            SEEN.update((source, target))
        self.moves.clear()

    @invariant()
    def each_mark_has_its_dict_entry(self) -> None:
        c = self.cache
        dicts: dict[Mark, Container[int]] = {
            Mark.WRITING: c._rows.writing,
            Mark.READING: c._rows.readers,
            Mark.HELD: c._guards.row_holds,
            Mark.PINNED: c._guards.pins,
            Mark.RESERVED: c._guards.reserved_by,
        }
        for row, key in enumerate(c._rows.keys):
            state = c._state.v[row]
            if key is None:
                assert state == 0
                assert all(row not in d for d in dicts.values())
                continue
            assert lifecycle.decode(state) is not None
            for mark, d in dicts.items():
                assert bool(state & mark) == (row in d)


def test_a_real_cache_makes_only_the_table_s_moves_and_every_one_of_them() -> None:
    PERFORMED.clear()
    SEEN.clear()
    run = LifecycleMachine.TestCase
    # Always the same examples, as many under `make mutate`: what they reach is checked below.
    run.settings = settings(
        max_examples=150, stateful_step_count=50, derandomize=True, database=None, deadline=None
    )
    run().runTest()
    assert set(Phase) == SEEN
    wanted = set(MOVES)
    for take, (_, phases) in TAKES.items():
        wanted |= {(phase, take) for phase in phases}
    for drop, mark in DROPS.items():
        wanted |= {(phase, drop) for phase, keeps in KEEPS.items() if mark in keeps}
    assert wanted - PERFORMED == set()
