"""PrefixUse: the cached keys of a request's prompt, touched once when it is first scheduled.

On vLLM's own ``ReqContext`` (the scheduler records each key's position in it): should a
vLLM release rename what PrefixUse reads, these fail instead of the cache silently aging
out the prefixes engines share.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from offloadd.vllm.prefix_use import MAX_TOUCHED, PrefixUse


def request(req_id: str, keys: list[bytes]) -> ReqContext:
    context = ReqContext(req_id=req_id)
    for position, key in enumerate(keys, start=1):
        context.set_offload_key_position(OffloadKey(key), position * 16)
    return context


def test_a_scheduled_request_touches_its_cached_keys_in_prefix_order_once() -> None:
    use = PrefixUse()
    use.started("r1", request("r1", [b"a", b"b", b"c", b"d"]))
    use.started("r2", request("r2", [b"a", b"x"]))
    assert use.take() == []  # nothing before a schedule
    use.scheduled(["r1"], cached={b"a", b"b", b"d"})
    assert use.take() == [b"a", b"b", b"d"]
    use.scheduled(["r1"], cached={b"a", b"b", b"d"})  # scheduled again (preempted): once
    assert use.take() == []
    use.finished("r2")  # finished before its first schedule: forgotten
    use.scheduled(["r2", "unknown"], cached={b"a", b"x"})
    assert use.take() == []


def test_touches_not_sent_are_bounded_keeping_the_newest() -> None:
    use = PrefixUse()
    keys = [i.to_bytes(4, "big") for i in range(MAX_TOUCHED + 10)]
    use.started("r", request("r", keys))
    use.scheduled(["r"], cached=set(keys))
    assert use.take() == keys[10:]
