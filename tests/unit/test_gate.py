"""RequestGate: a peer's requests wait while its Hello is handled off the loop, in order."""

from __future__ import annotations

from offloadd.server.gate import RequestGate


def test_only_a_closed_peer_is_held_and_released_in_order() -> None:
    gate = RequestGate()
    assert not gate.hold(b"a", [b"1"])  # nobody is closed: handle at once
    gate.close(b"a")
    assert gate.hold(b"a", [b"2"]) and gate.hold(b"a", [b"3"])
    assert not gate.hold(b"b", [b"x"])  # other peers are not held
    assert gate.next(b"a") is None  # still closed
    gate.open(b"a")
    assert gate.hold(b"a", [b"4"])  # queued frames go first: later ones queue behind them
    assert [gate.next(b"a"), gate.next(b"a"), gate.next(b"a")] == [[b"2"], [b"3"], [b"4"]]
    assert gate.next(b"a") is None
    assert len(gate) == 0 and not gate.hold(b"a", [b"5"])


def test_a_second_hello_among_the_held_requests_holds_the_rest_again() -> None:
    gate = RequestGate()
    gate.close(b"a")
    for frame in (b"hello-2", b"lookup", b"stats"):
        gate.hold(b"a", [frame])
    gate.open(b"a")
    assert gate.next(b"a") == [b"hello-2"]
    gate.close(b"a")  # handling it started another off-loop Hello
    assert gate.next(b"a") is None
    assert gate.hold(b"a", [b"late"])
    gate.open(b"a")
    assert [gate.next(b"a"), gate.next(b"a"), gate.next(b"a")] == [
        [b"lookup"],
        [b"stats"],
        [b"late"],
    ]
    assert gate.next(b"a") is None and len(gate) == 0
