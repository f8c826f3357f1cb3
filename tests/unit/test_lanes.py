"""Lanes: control requests before bulk work, one peer's requests in the order it sent them."""

from __future__ import annotations

from offloadd.server.lanes import Lanes


def drain(lanes: Lanes) -> list[object]:
    order: list[object] = []
    while (popped := lanes.pop()) is not None:
        item, _bulk = popped
        order.append(item if callable(item) else item[1][0])
    return order


def test_a_lookup_queued_behind_stores_and_copy_ends_goes_first() -> None:
    lanes = Lanes(burst=32)
    for index in range(8):
        lanes.add(b"worker", [f"store-{index}".encode()], urgent=False)

    def copy_end() -> None:
        pass

    lanes.add_work(copy_end)
    lanes.add(b"scheduler", [b"lookup"], urgent=True)
    assert lanes.requests == 9 and len(lanes) == 10
    order = drain(lanes)
    assert order[0] == b"lookup"
    assert order[1:] == [f"store-{i}".encode() for i in range(8)] + [copy_end]
    assert lanes.requests == 0 and len(lanes) == 0


def test_one_peers_control_request_stays_behind_its_own_bulk_request() -> None:
    lanes = Lanes(burst=32)
    lanes.add(b"a", [b"a-lookup-0"], urgent=True)  # nothing of a's queued: control lane
    lanes.add(b"a", [b"a-store"], urgent=False)
    lanes.add(b"a", [b"a-lookup-1"], urgent=True)  # behind a-store
    lanes.add(b"b", [b"b-lookup"], urgent=True)
    popped = [lanes.pop() for _ in range(3)]
    assert [(p[0][1][0], p[1]) for p in popped if p and isinstance(p[0], tuple)] == [
        (b"a-lookup-0", False),
        (b"b-lookup", False),
        (b"a-store", True),
    ]
    # a-lookup-1 is still in the bulk lane: a later control request of a's queues behind it.
    lanes.add(b"a", [b"a-lookup-2"], urgent=True)
    lanes.add(b"b", [b"b-lookup-2"], urgent=True)
    assert drain(lanes) == [b"b-lookup-2", b"a-lookup-1", b"a-lookup-2"]
    lanes.add(b"a", [b"a-lookup-3"], urgent=True)  # a has nothing queued again
    assert lanes.pop() == ((b"a", [b"a-lookup-3"]), False)


def test_a_flood_of_control_requests_lets_one_bulk_item_through_per_burst() -> None:
    lanes = Lanes(burst=4)
    for index in range(10):
        lanes.add(f"s{index}".encode(), [b"lookup"], urgent=True)
    lanes.add(b"w", [b"store-0"], urgent=False)
    lanes.add(b"w", [b"store-1"], urgent=False)
    order = drain(lanes)
    assert (
        order == [b"lookup"] * 4 + [b"store-0"] + [b"lookup"] * 4 + [b"store-1"] + [b"lookup"] * 2
    )
