"""A rank in its own process, for tests that kill ranks: ``python -m ... ENDPOINT RANK TP ACTION``.

It registers shared-memory KV regions filled from its rank number, then performs ACTION
(``store`` or ``load`` of four chunks), prints ``accepted`` once the daemon accepted the job,
and waits for its stdin to close (the test kills it before that).
"""

from __future__ import annotations

import sys

from tests.integration.harness import chain_keys, chunk_block_ids, make_rank


def main() -> None:
    endpoint, rank_id, tp, action = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rank = make_rank(endpoint, rank=rank_id, tp=tp)
    rank.fill(rank_id)
    assert rank.client is not None
    rank.client.wait_ready(10)
    keys = chain_keys(4)
    if action == "store":
        rank.client.store(1, keys, chunk_block_ids(range(4), 2))
    else:
        rank.client.load(1, keys, chunk_block_ids(range(4), 2, 100))
    print("accepted", flush=True)
    sys.stdin.read()
    rank.close()


if __name__ == "__main__":
    main()
