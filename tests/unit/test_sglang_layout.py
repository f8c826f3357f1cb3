"""The SGLang backend's pure part: page runs, namespace config, keys (no SGLang needed)."""

from __future__ import annotations

import pytest

from offloadd.sglang.layout import PageRun, offload_key, offloading_config, page_runs


def test_page_runs_of_a_page_first_pool() -> None:
    base, page_bytes, v_offset, pages = 1000, 96, 96 * 10, 10

    def meta(i: int) -> tuple[list[int], list[int]]:
        return [base + i * page_bytes, base + v_offset + i * page_bytes], [page_bytes] * 2

    runs = page_runs(base, meta(0), meta(1), meta(9), pages)
    assert runs == [PageRun(0, 96, 96), PageRun(960, 96, 96)]


def test_uneven_pages_are_refused() -> None:
    with pytest.raises(ValueError, match="last page"):
        page_runs(0, ([0], [8]), ([8], [8]), ([100], [8]), 10)


def _config(**kw: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        engine_id="e",
        model="m",
        dtype="torch.bfloat16",
        page_tokens=4,
        runs=[PageRun(0, 8, 8)],
        layout="page_first",
        tp_size=2,
        tp_rank=1,
        is_mla=False,
    )
    args.update(kw)
    return dict(offloading_config(**args).extra_config)  # type: ignore[arg-type]


def test_namespace_salt_names_tp_rank_except_under_mla() -> None:
    assert _config()["namespace"] != _config(tp_rank=0)["namespace"]
    assert _config(is_mla=True)["namespace"] == _config(is_mla=True, tp_rank=0)["namespace"]
    assert _config()["namespace"] != _config(layout="layer_first")["namespace"]


def test_keys_are_the_hash_bytes_and_group_zero() -> None:
    digest = "ab" * 32
    assert offload_key(digest) == bytes.fromhex(digest) + b"\0\0\0\0"
    assert len(offload_key("not-hex")) == 36
