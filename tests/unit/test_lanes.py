"""Lanes: control requests before bulk work, one peer's requests in the order it sent them,
tenants served in turn within each lane."""

from __future__ import annotations

from offloadd.server.lanes import QUANTUM_ITEMS, UNIT, Lanes, Next


def drain(lanes: Lanes) -> list[object]:
    order: list[object] = []
    while (popped := lanes.pop()) is not None:
        item, _bulk = popped
        if isinstance(item, Next):
            order.append(item.work)
        else:
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


def _tenants(peers: dict[bytes, str]) -> Lanes:
    return Lanes(burst=32, tenant_of=lambda peer: peers.get(peer, ""))


def test_a_flood_of_one_tenant_delays_anothers_request_by_one_item_per_lane() -> None:
    # Tenant A's four sessions flood both lanes (N items each); tenant B's request, in either
    # lane, is served after at most one of A's items of its lane (weight 1).
    flooders = {f"a{index}".encode(): "u1" for index in range(4)}
    lanes = _tenants({**flooders, b"b": "u2"})
    n = 200
    for _ in range(n):
        for peer in flooders:
            lanes.add(peer, [b"a-lookup"], urgent=True)
            lanes.add(peer, [b"a-store"], urgent=False)
    for _ in range(3):
        lanes.pop()  # the loop was busy with A when B's requests arrived
    lanes.add(b"b", [b"b-lookup"], urgent=True)
    order = drain(lanes)
    assert order.index(b"b-lookup") <= 1
    lanes = _tenants({**flooders, b"b": "u2"})
    for _ in range(n):
        for peer in flooders:
            lanes.add(peer, [b"a-store"], urgent=False)
    lanes.pop()
    lanes.add(b"c", [b"sessionless-hello"], urgent=False)  # peers with no session: one turn
    lanes.add(b"b", [b"b-store"], urgent=False)
    order = drain(lanes)
    assert order.index(b"sessionless-hello") <= 1 and order.index(b"b-store") <= 3
    assert order.count(b"a-store") == 4 * n - 1


def test_a_bulk_request_waits_for_at_most_burst_control_items_per_bulk_turn() -> None:
    # A floods Lookups and Stores; B's store waits for one of A's stores and the control
    # items between two bulk turns: at most 2 * burst + 1 of A's items, whatever N.
    burst = 8
    lanes = Lanes(burst=burst, tenant_of=lambda peer: peer[:1].decode())
    for _ in range(500):
        lanes.add(b"a", [b"a-lookup"], urgent=True)
        lanes.add(b"A", [b"a-store"], urgent=False)  # tenant "A": another flooding tenant
    lanes.add(b"b", [b"b-store"], urgent=False)
    order = drain(lanes)
    assert order.index(b"b-store") <= 2 * burst + 1


def test_copy_ends_take_their_tenants_turn() -> None:
    lanes = _tenants({b"a": "u1"})
    for _ in range(50):
        lanes.add(b"a", [b"a-store"], urgent=False)
        lanes.add_work(lambda: None, "u1")  # the end of one of A's copies

    def b_copy_end() -> None:
        pass

    lanes.add_work(b_copy_end, "u2")
    assert drain(lanes).index(b_copy_end) <= 1


def test_weights_give_a_tenant_that_many_items_per_turn() -> None:
    lanes = Lanes(
        burst=32,
        tenant_of=lambda peer: peer[:1].decode(),
        weight_of=lambda tenant: 3 if tenant == "h" else 1,
    )
    for index in range(6):
        lanes.add(f"h{index}".encode(), [b"h"], urgent=True)
        lanes.add(f"l{index}".encode(), [b"l"], urgent=True)
    assert drain(lanes) == [b"h", b"h", b"h", b"l", b"h", b"h", b"h", b"l", b"l", b"l", b"l", b"l"]


def test_a_peers_requests_stay_in_order_when_its_tenant_changes() -> None:
    # Read before its Hello was handled, a peer's requests queue under the sessionless turn;
    # those read after stay behind them, under that turn, until none of its requests is left.
    tenants = {b"p": ""}
    lanes = Lanes(burst=32, tenant_of=lambda peer: tenants[peer])
    lanes.add(b"p", [b"hello"], urgent=False)
    lanes.add(b"p", [b"lookup-1"], urgent=True)
    assert lanes.pop() == ((b"p", [b"hello"]), True)
    tenants[b"p"] = "u1"  # the Hello made its session
    lanes.add(b"p", [b"lookup-2"], urgent=True)
    assert drain(lanes) == [b"lookup-1", b"lookup-2"]
    lanes.add(b"p", [b"lookup-3"], urgent=True)
    tenants[b"q"] = "u1"
    lanes.add(b"q", [b"q-lookup"], urgent=True)
    assert drain(lanes) == [b"lookup-3", b"q-lookup"]
    assert lanes.requests == 0 and len(lanes) == 0


def test_the_rest_of_a_request_goes_ahead_of_its_peers_later_requests() -> None:
    lanes = Lanes(burst=32, tenant_of=lambda peer: peer.decode()[0])
    lanes.add(b"a1", [b"a1-reserve"], urgent=True)
    lanes.add(b"a2", [b"a2-lookup"], urgent=True)
    lanes.add(b"b", [b"b-lookup"], urgent=True)
    assert lanes.pop() == ((b"a1", [b"a1-reserve"]), False)
    lanes.add(b"a1", [b"a1-lookup"], urgent=True)  # read while a1's reserve runs

    def rest() -> None:
        pass

    lanes.add_next(b"a1", rest, bulk=False)  # the reserve's nested lookups, cut short
    # b's turn first (tenant a just had one), then a's, the rest ahead of a2 and a1's next.
    order = drain(lanes)
    assert order == [b"b-lookup", rest, b"a2-lookup", b"a1-lookup"]
    assert len(lanes) == 0 and lanes.requests == 0


def test_the_rest_of_a_bulk_request_keeps_its_peers_control_requests_behind_it() -> None:
    lanes = Lanes(burst=32)
    lanes.add(b"a", [b"a-big-step"], urgent=False)
    assert lanes.pop() == ((b"a", [b"a-big-step"]), True)

    def rest() -> None:
        pass

    lanes.add_next(b"a", rest, bulk=True)
    lanes.add(b"a", [b"a-lookup"], urgent=True)  # a has the rest in the bulk lane: behind it
    lanes.add(b"b", [b"b-lookup"], urgent=True)
    assert drain(lanes) == [b"b-lookup", rest, b"a-lookup"]


def test_the_bytes_read_ahead_are_counted_until_each_request_is_popped() -> None:
    lanes = Lanes(burst=32)
    lanes.add(b"a", [b"x" * 100], urgent=True)
    lanes.add(b"b", [b"y" * 1000], urgent=False)
    lanes.add_work(lambda: None)
    assert lanes.bytes == 1100
    lanes.pop()
    assert lanes.bytes == 1000
    drain(lanes)
    assert lanes.bytes == 0


def test_large_control_items_let_bulk_through_sooner() -> None:
    lanes = Lanes(burst=32)
    big = [b"x" * (16 * UNIT)]  # a step message of 256 KiB counts 17 small ones
    for _ in range(10):
        lanes.add(b"flood", big, urgent=True)
    lanes.add(b"victim", [b"store"], urgent=False)
    popped = [lanes.pop() for _ in range(3)]
    assert [bulk for _item, bulk in filter(None, popped)] == [False, False, True]

    def rest() -> None:
        pass

    lanes = Lanes(burst=32)
    for _ in range(4):
        lanes.add_next(b"flood", rest, bulk=False)  # quanta count QUANTUM_ITEMS each
    lanes.add(b"victim", [b"store"], urgent=False)
    order = [bulk for _item, bulk in filter(None, (lanes.pop() for _ in range(5)))]
    assert order == [False, False, True, False, False]
    assert QUANTUM_ITEMS * 2 >= 32
