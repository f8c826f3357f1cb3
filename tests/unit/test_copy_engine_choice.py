"""``server.copy_engine = "auto"``: cuda only with a device and a driver with the batch copy."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from offloadd.transfer import choice, libcuda


class FakeLib:
    """A driver library: the symbols given exist, and cuDeviceGetCount reports ``devices``."""

    def __init__(self, devices: int, *, batch: bool = True) -> None:
        self.devices = devices
        if batch:
            # Any C function pointer will do: it is only resolved, never called here.
            self.cuMemcpyBatchAsync = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    def cuInit(self, flags: int) -> int:
        return 0

    def cuDeviceGetCount(self, count: Any) -> int:
        ctypes.cast(count, ctypes.POINTER(ctypes.c_int)).contents.value = self.devices
        return 0


class FakeDriver:
    def __init__(self, lib: FakeLib) -> None:
        self.lib = lib


def use_driver(monkeypatch: pytest.MonkeyPatch, lib: FakeLib | None) -> None:
    monkeypatch.setattr(libcuda, "load", lambda: FakeDriver(lib) if lib else None)


def test_explicit_engines_are_kept() -> None:
    assert choice.choose_copy_engine("cpu") == ("cpu", "")
    assert choice.choose_copy_engine("cuda") == ("cuda", "")


def test_auto_picks_cpu_on_this_machine() -> None:
    # No GPU here: whatever the reason, auto must fall back to the cpu engine and say why.
    engine, why = choice.choose_copy_engine("auto")
    if libcuda.load() is None:
        assert (engine, why) == ("cpu", "no CUDA driver (libcuda.so.1)")
    else:
        assert engine == "cpu" or choice.cuda_copy_problem() == ""


@pytest.mark.parametrize(
    ("lib", "expected"),
    [
        (None, ("cpu", "no CUDA driver (libcuda.so.1)")),
        (FakeLib(1, batch=False), ("cpu", "CUDA 12.8 or newer")),
        (FakeLib(0), ("cpu", "no CUDA device is visible")),
        (FakeLib(2), ("cuda", "batched copy")),
    ],
)
def test_auto_asks_the_driver(
    monkeypatch: pytest.MonkeyPatch, lib: FakeLib | None, expected: tuple[str, str]
) -> None:
    use_driver(monkeypatch, lib)
    engine, why = choice.choose_copy_engine("auto")
    assert engine == expected[0]
    assert expected[1] in why
