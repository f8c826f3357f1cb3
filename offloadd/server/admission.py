"""Admission: whether a request may run, one function per request kind, each run once.

Each function raises ``Refused`` (the code and message the daemon answers) or returns what
its handler goes on with, the session's engine and namespace; its checks run in the order
their refusals take precedence. They decide who may ask and when (role, a ready engine, the
drain, the session's jobs, the keys, the rank's files, a deadline); the request's shape
(block ids, ranges) is checked where it is planned (``offloadd.server.requests``).

Contract of ``Admission`` (the event loop's thread only):
- ``keyed(state, keys)`` (Lookup, Release): a ready engine, its keys (``check_keys``);
  ``ready(state)`` (Clear): a ready engine.
- ``store(state, request, step)``: not while draining (its keys counted refused, reason
  ``draining``), then ``job``, then its deadline (``DEADLINE_PASSED``, keys counted
  ``late``). ``load(state, request, step)``: not while draining, then ``job``.
- ``job``: a worker rank of a ready engine (recorded in ``usage``), a job id not in flight,
  at most ``limits.jobs_per_session`` in flight, the keys, the rank's files as large as when
  it registered; a reused job id's old result is forgotten. ``step``: the job's StepJobs'
  ``Step``; when its jobs passed their checks together, none runs again.
- ``step(state, jobs)``: a worker rank of a ready engine and its files, once for a StepJobs;
  ``Step.checked`` says whether every job passes ``job``'s checks and its block ids together.
- ``waited(state, deadline, keys)``: a store that waited for its room, about to start: a
  ready engine, the rank's files, its deadline.
- ``reserve(state, request)``: a scheduler of a ready engine, its keys, not while draining
  (keys counted), every key's group offloaded. ``update_holds(state)``: a scheduler of a
  ready engine, not while draining.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

from offloadd.server.checks import (
    Refused,
    check_keys,
    check_offloaded,
    keys_pass_together,
    ready_engine,
)
from offloadd.server.jobs import Jobs
from offloadd.server.limits import Limits
from offloadd.server.registry import Engine, Namespace, Registry
from offloadd.server.state import SessionState
from offloadd.server.usage import Usage
from offloadd.transfer.guarded import shrunk
from offloadd.transfer.plan import block_id_problem
from protocol.errors import ErrorCode
from protocol.messages import Load, Reserve, Store

__all__ = ["Admission", "Step"]


class Step(NamedTuple):
    """A StepJobs' engine and namespace (its rank's files checked too: once for all its
    jobs), and whether its jobs passed their checks together: then each job's own are not
    run again."""

    engine: Engine
    namespace: Namespace
    checked: bool


class Admission:
    """One admission function per request kind; see the module docstring."""

    def __init__(
        self, registry: Registry, jobs: Jobs, limits: Limits, usage: Usage | None = None
    ) -> None:
        self._registry = registry
        self._jobs = jobs
        self._limits = limits
        self._usage = usage

    def ready(self, state: SessionState) -> tuple[Engine, Namespace]:
        """Clear: the session's engine is ready."""
        return ready_engine(self._registry, state.session)

    def keyed(self, state: SessionState, keys: list[bytes]) -> tuple[Engine, Namespace]:
        """Lookup, Release: a ready engine, and keys it can name."""
        engine, namespace = ready_engine(self._registry, state.session)
        check_keys(keys, engine, self._limits)
        return engine, namespace

    def store(
        self, state: SessionState, request: Store, step: Step | None
    ) -> tuple[Engine, Namespace]:
        """A rank's Store (alone, or a job of ``step``)."""
        self._jobs.refuse_while_draining(len(request.keys))
        where = self._job(state, request.job_id, request.keys, step)
        self._jobs.refuse_late(request.deadline, request.keys)  # its blocks may be reused
        return where

    def load(
        self, state: SessionState, request: Load, step: Step | None
    ) -> tuple[Engine, Namespace]:
        """A rank's Load (alone, or a job of ``step``)."""
        if step is None or not step.checked:  # a step checked together was not draining
            self._jobs.refuse_while_draining()
        return self._job(state, request.job_id, request.keys, step)

    def _job(
        self, state: SessionState, job_id: int, keys: list[bytes], step: Step | None
    ) -> tuple[Engine, Namespace]:
        if step is not None and step.checked:
            state.done.pop(job_id, None)
            return step.engine, step.namespace
        engine, namespace = self._worker(state) if step is None else (step.engine, step.namespace)
        if job_id in state.jobs:
            raise Refused(ErrorCode.DUPLICATE_JOB, f"job {job_id} is still running")
        most = self._limits.settings.jobs_per_session
        if len(state.jobs) >= most:
            raise Refused(
                ErrorCode.TOO_LARGE, f"{most} jobs in flight already (limits.jobs_per_session)"
            )
        check_keys(keys, engine, self._limits)
        if step is None:
            _check_files(state)
        state.done.pop(job_id, None)  # a reused id: Wait must report the new job, not the old
        return engine, namespace

    def step(self, state: SessionState, jobs: Sequence[Store | Load]) -> Step:
        """A StepJobs: its rank and files once, and whether its jobs pass together."""
        # Once for the step's jobs, planned in this one turn of the loop: an fstat per
        # job gave the GIL to a copy thread each time, and took 0.2 ms to get it back.
        engine, namespace = self._worker(state)
        _check_files(state)
        return Step(engine, namespace, self._together(state, jobs, engine))

    def _together(self, state: SessionState, jobs: Sequence[Store | Load], engine: Engine) -> bool:
        """Whether the step's jobs all pass ``_job``'s checks (but for draining and files)
        and their block ids are in range, checked as one at C speed: 256 jobs' checks one by
        one cost ~0.5 ms. When not, each job is checked alone, for its own refusal."""
        ids = {job.job_id for job in jobs}
        settings = self._limits.settings
        if (
            self._jobs.draining
            or not jobs
            or len(ids) < len(jobs)
            or not state.jobs.keys().isdisjoint(ids)
            or len(state.jobs) + len(jobs) > settings.jobs_per_session
        ):
            return False
        block_ids = list(chain.from_iterable(job.block_ids for job in jobs))
        return keys_pass_together(
            [job.keys for job in jobs], engine, self._limits
        ) and not block_id_problem(block_ids, state.session.num_blocks)

    def waited(self, state: SessionState, deadline: float, keys: Sequence[bytes]) -> Engine:
        """A store that waited for its room, about to start: still allowed?"""
        engine, _ = ready_engine(self._registry, state.session)
        _check_files(state)
        self._jobs.refuse_late(deadline, keys)  # it waited past the rank's bound
        return engine

    def _worker(self, state: SessionState) -> tuple[Engine, Namespace]:
        """A worker rank of a ready engine: that engine and its namespace."""
        if state.session.role != "worker":
            raise Refused(ErrorCode.WRONG_ROLE, "only worker ranks store and load")
        engine, namespace = ready_engine(self._registry, state.session)
        if self._usage is not None:
            self._usage.used(engine.key, namespace.name)
        return engine, namespace

    def reserve(self, state: SessionState, request: Reserve) -> tuple[Engine, Namespace]:
        """A scheduler's Reserve."""
        engine, namespace = self._scheduler(state)
        check_keys(request.keys, engine, self._limits)
        self._jobs.refuse_while_draining(len(request.keys))
        check_offloaded(request.keys, namespace)
        return engine, namespace

    def update_holds(self, state: SessionState) -> tuple[Engine, Namespace]:
        """A scheduler's UpdateHolds."""
        engine, namespace = self._scheduler(state)
        self._jobs.refuse_while_draining()
        return engine, namespace

    def _scheduler(self, state: SessionState) -> tuple[Engine, Namespace]:
        if state.session.role != "scheduler":
            raise Refused(ErrorCode.WRONG_ROLE, "only schedulers reserve and hold keys")
        return ready_engine(self._registry, state.session)


def _check_files(state: SessionState) -> None:
    """A rank file that shrank fails here, never in a copy."""
    problem = shrunk(state.unsealed)
    if problem:
        raise Refused(ErrorCode.HANDLE_OPEN_FAILED, problem)
