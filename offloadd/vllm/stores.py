"""The scheduler's stores, from ``prepare_store`` to their commit in the mirror (pure logic).

vLLM 0.33 calls ``prepare_store`` once per request inside ``schedule()`` and builds the
request's GPU spec from its answer at once; ``on_schedule_end`` is the step's last manager
call, before the metadata holding the store specs leaves the scheduler. So a step's stores
are answered locally and sent together, in one ``Reserve`` nothing waits for:
- ``candidates``: of a request's keys, those neither committed nor stored by this scheduler
  already (queued this step, in flight, committing);
- ``queue``: they go into the request's ``OffloaddStoreSpec`` and wait for the step's
  ``Reserve`` (``queued_keys``: every spec's keys, in order; ``has_queued``: any at all);
- ``take``: the step's stores (``StepStores``: its specs, its keys in order) as the
  ``Reserve`` leaves; its keys are in flight from now on (``pending``);
- ``skip``: the ``Reserve`` could not be sent (no daemon, too many unanswered): every key of
  the step is marked skipped in its spec by position (``OffloaddStoreSpec.skipped``, before
  the spec leaves), so the ranks do not store it, and is stored by nobody here;
- ``answered``: the daemon's late answer, indices into the step's keys. A key it did not
  reserve (another engine stores it, no room, the step refused: ``answered(step, ())``) is
  stored by nobody: the ranks' ``Store(reserved=True)`` skips it at the daemon, so it leaves
  the flight (or the committing keys, when vLLM completed its job already) and misses again;
- ``complete``: vLLM reports the request's job done (skipped keys included). A key no
  longer in flight whose commit has not reached the mirror yet is committing: still
  ``pending`` (HIT_PENDING, not a miss) until ``committed`` sees its notice, or for
  ``commit_wait`` seconds at most (a commit the daemon refused, or a step never answered).
``forget`` (a lost session) drops what is in flight and committing; ``reset`` (vLLM's cache
reset, which flushes the jobs without completing them) drops everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from offloadd.vllm.transfer_specs import OffloaddStoreSpec

__all__ = ["COMMIT_WAIT_SECONDS", "StepStores", "Stores"]

COMMIT_WAIT_SECONDS = 1.0  # a stored key pends at most this long for its commit notice


@dataclass(frozen=True)
class StepStores:
    """One step's stores as its ``Reserve`` carries them."""

    specs: list[tuple[str, OffloaddStoreSpec]]  # (request, spec), in order
    keys: list[bytes]  # every spec's keys, spec after spec


class Stores:
    """The keys this scheduler stores; see the module docstring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        commit_wait: float = COMMIT_WAIT_SECONDS,
    ) -> None:
        self._clock = clock
        self._commit_wait = commit_wait
        self._queued: list[tuple[str, OffloaddStoreSpec]] = []  # this step's specs, in order
        self._queued_keys: dict[bytes, int] = {}  # their keys, counted
        self._in_flight: dict[bytes, int] = {}  # reserved, the ranks storing them (counted)
        self._committing: dict[bytes, float] = {}  # stored, the notice due before this time
        # (request, key) of skipped keys whose job vLLM has yet to complete, counted.
        self._skipped: dict[tuple[str, bytes], int] = {}

    @property
    def storing(self) -> int:
        """Keys reserved and being stored."""
        return len(self._in_flight)

    def candidates(self, keys: Iterable[bytes], committed: Collection[bytes]) -> list[bytes]:
        """The keys worth storing: not committed, not stored here already, each once."""
        out: list[bytes] = []
        seen: set[bytes] = set()
        for key in keys:
            if key in committed or key in seen or self.pending(key):
                continue
            seen.add(key)
            out.append(key)
        return out

    def queue(self, token: str, keys: list[bytes]) -> OffloaddStoreSpec:
        """A spec for request ``token``'s ``keys``, settled with the step."""
        spec = OffloaddStoreSpec(keys)
        if keys:
            self._queued.append((token, spec))
            for key in keys:
                self._queued_keys[key] = self._queued_keys.get(key, 0) + 1
        return spec

    @property
    def has_queued(self) -> bool:
        """Some spec of this step has keys to reserve."""
        return bool(self._queued)

    @property
    def awaiting_commits(self) -> bool:
        """Some key stored here has not reached the mirror: reserved and being stored, or
        stored and its commit notice due."""
        return bool(self._in_flight) or self.committing()

    def queued_keys(self) -> list[bytes]:
        """Every queued spec's keys, spec after spec (the step's ``Reserve``)."""
        return [key for _token, spec in self._queued for key in spec.keys]

    def take(self) -> StepStores:
        """The step's stores, their keys in flight from now on."""
        keys = self.queued_keys()
        queued, self._queued, self._queued_keys = self._queued, [], {}
        for key in keys:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return StepStores(queued, keys)

    def skip(self, step: StepStores) -> int:
        """The step's ``Reserve`` was not sent: its specs skip every key. Returns how many."""
        for key in step.keys:
            self._leave(key)
        for token, spec in step.specs:
            spec.skipped.update(range(len(spec.keys)))
            for key in spec.keys:
                pair = (token, key)
                self._skipped[pair] = self._skipped.get(pair, 0) + 1
        return len(step.keys)

    def answered(self, step: StepStores, reserved: Iterable[int]) -> int:
        """The daemon reserved these indices of ``step.keys``; nobody stores the others.
        Returns how many it did not reserve."""
        chosen = set(reserved)
        refused = 0
        for index, key in enumerate(step.keys):
            if index not in chosen:
                self._leave(key)
                refused += 1
        return refused

    def _leave(self, key: bytes) -> None:
        """``key`` is not stored after all: out of the flight, or of the committing keys."""
        count = self._in_flight.get(key, 0)
        if count > 1:
            self._in_flight[key] = count - 1
        elif count:
            del self._in_flight[key]
        else:
            self._committing.pop(key, None)

    def complete(self, token: str, keys: Iterable[bytes], committed: Collection[bytes]) -> None:
        """vLLM says request ``token``'s store of ``keys`` is done on every rank."""
        now = self._clock()
        self._expire(now)
        for key in keys:
            pair = (token, key)
            count = self._skipped.get(pair, 0)
            if count:
                if count > 1:
                    self._skipped[pair] = count - 1
                else:
                    del self._skipped[pair]
                continue
            count = self._in_flight.get(key, 0)
            if count > 1:
                self._in_flight[key] = count - 1
                continue
            if self._in_flight.pop(key, None) is not None and key not in committed:
                self._committing.pop(key, None)  # to the end: deadlines stay in order
                self._committing[key] = now + self._commit_wait

    def committed(self, keys: Iterable[bytes]) -> None:
        """These keys' commits reached the mirror."""
        if self._committing:
            for key in keys:
                self._committing.pop(key, None)

    def pending(self, key: bytes) -> bool:
        """Being stored here: in flight, or stored and its commit not in the mirror yet."""
        if key in self._in_flight or key in self._queued_keys:
            return True
        due = self._committing.get(key)
        if due is None:
            return False
        if self._clock() < due:
            return True
        del self._committing[key]
        return False

    def committing(self) -> bool:
        """Some stored key's commit notice is still due."""
        self._expire(self._clock())
        return bool(self._committing)

    def forget(self) -> None:
        """The session is gone: nothing is in flight or committing in the new one (this
        step's queue is still sent, to the new session or nowhere)."""
        self._in_flight.clear()
        self._committing.clear()

    def reset(self) -> None:
        """vLLM flushed every store job and completes none of them."""
        self.forget()
        self._skipped.clear()
        for _token, spec in self._queued:
            spec.skipped.update(range(len(spec.keys)))
        self._queued, self._queued_keys = [], {}

    def _expire(self, now: float) -> None:
        committing = self._committing
        while committing:
            key = next(iter(committing))
            if committing[key] > now:
                return
            del committing[key]
