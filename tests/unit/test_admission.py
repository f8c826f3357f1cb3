"""offloadd.server.admission: each request kind is admitted in one call, its checks run once.

Real registry and limits; the jobs are a fake that counts the drain and deadline checks. A
source scan holds the daemon's handlers to calling the shared checks only through it.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from offloadd.server.admission import Admission
from offloadd.server.checks import Refused
from offloadd.server.limits import Limits
from offloadd.server.registry import Engine, Registry
from offloadd.server.state import SessionState
from offloadd.settings import LimitsSettings
from protocol.errors import ErrorCode
from protocol.messages import Load, Store
from tests.helpers import register_engine

SERVER = Path(__file__).resolve().parents[2] / "offloadd" / "server"


@dataclass
class CountingJobs:
    draining: bool = False
    calls: list[tuple[str, int]] = field(default_factory=list)

    def refuse_while_draining(self, store_keys: int = 0) -> None:
        self.calls.append(("draining", store_keys))
        if self.draining:
            raise Refused(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")

    def refuse_late(self, deadline: float, keys: Sequence[bytes]) -> None:
        self.calls.append(("late", len(keys)))


class CountingRegistry(Registry):
    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0

    def engine(self, key: tuple[str, int]) -> Engine | None:
        self.lookups += 1
        return super().engine(key)


def rig() -> tuple[Admission, CountingJobs, CountingRegistry, SessionState]:
    registry = CountingRegistry()
    session = register_engine(registry)[-1].session
    jobs = CountingJobs()
    admission = Admission(registry, jobs, Limits(LimitsSettings()))  # type: ignore[arg-type]
    registry.lookups = 0
    return admission, jobs, registry, SessionState(b"rank", session, [])


KEYS = [b"h" * 8 + bytes(4)]


def test_a_store_is_admitted_in_one_pass_of_each_check() -> None:
    admission, jobs, registry, state = rig()
    engine, namespace = admission.store(state, Store(1, 7, KEYS, [0]), None)
    assert engine.namespace is namespace
    assert jobs.calls == [("draining", 1), ("late", 1)]  # each once, the drain counting keys
    assert registry.lookups == 1  # the ready engine looked up once


def test_a_load_is_admitted_in_one_pass_and_counts_no_keys_while_draining() -> None:
    admission, jobs, registry, state = rig()
    admission.load(state, Load(1, 8, KEYS, [0]), None)
    assert jobs.calls == [("draining", 0)] and registry.lookups == 1
    jobs.draining = True
    with pytest.raises(Refused) as refused:
        admission.store(state, Store(2, 9, KEYS, [0]), None)
    assert refused.value.code == ErrorCode.SHUTTING_DOWN
    assert jobs.calls[1:] == [("draining", 1)]  # refused at once: nothing more ran


def test_a_step_checked_together_admits_its_jobs_without_checking_them_again() -> None:
    admission, jobs, registry, state = rig()
    step = admission.step(state, [Store(0, 1, KEYS, [0, 1]), Load(0, 2, KEYS, [2, 3])])
    assert step.checked and registry.lookups == 1
    admission.store(state, Store(0, 1, KEYS, [0, 1]), step)
    admission.load(state, Load(0, 2, KEYS, [2, 3]), step)
    assert registry.lookups == 1  # the step's engine, not looked up per job
    assert jobs.calls == [("draining", 1), ("late", 1)]


def _calls(path: Path, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in names:
                found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_handlers_admit_only_through_admission() -> None:
    shared = {"ready_engine", "refuse_while_draining"}
    outside = [
        call
        for path in sorted(SERVER.glob("*.py"))
        if path.name not in {"admission.py", "checks.py", "jobs.py"}
        for call in _calls(path, shared)
    ]
    assert outside == []
