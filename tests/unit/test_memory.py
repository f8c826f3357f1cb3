"""offloadd.server.memory: the memory an arena may take, read from fake cgroup and meminfo
files; and check-config's warning when the capacity is more."""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadd import cli
from offloadd.server import preflight
from offloadd.server.memory import (
    MemoryLimit,
    available_memory,
    cgroup_memory_limit,
    mem_total,
)
from offloadd.server.preflight import capacity_problem

GiB = 1 << 30
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes when no limit is set


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


def limit_of(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> MemoryLimit | None:
    write(tmp_path / "cgroup", files)
    (tmp_path / "proc_cgroup").write_text(proc_cgroup)
    return cgroup_memory_limit(str(tmp_path / "proc_cgroup"), str(tmp_path / "cgroup"))


def test_v2_the_processs_own_cgroup(tmp_path: Path) -> None:
    found = limit_of(
        tmp_path,
        "0::/system.slice/offloadd.service\n",
        {"system.slice/offloadd.service/memory.max": str(8 * GiB)},
    )
    assert found is not None and found.nbytes == 8 * GiB
    assert found.what == (
        f"the memory limit of its cgroup ({tmp_path}/cgroup/system.slice/offloadd.service/"
        "memory.max)"
    )


def test_v2_the_lowest_limit_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    files = {
        "kubepods/memory.max": str(64 * GiB),
        "kubepods/pod1/memory.max": str(16 * GiB),
        "kubepods/pod1/offloadd/memory.max": "max",
    }
    found = limit_of(tmp_path, "0::/kubepods/pod1/offloadd\n", files)
    assert found is not None and found.nbytes == 16 * GiB
    assert found.what.endswith("/kubepods/pod1/memory.max)")


def test_v2_without_any_limit_is_none(tmp_path: Path) -> None:
    files = {"user.slice/memory.max": "max", "user.slice/session-1.scope/memory.max": "max"}
    assert limit_of(tmp_path, "0::/user.slice/session-1.scope\n", files) is None


def test_v2_a_path_the_mount_does_not_show_falls_back_to_its_root(tmp_path: Path) -> None:
    # A container without a cgroup namespace: /proc/self/cgroup names the host's path, and
    # /sys/fs/cgroup is the container's own cgroup.
    found = limit_of(tmp_path, "0::/kubepods/burstable/pod9/abc\n", {"memory.max": str(GiB)})
    assert found is not None and found.nbytes == GiB


def test_v1_memory_on_a_hybrid_host(tmp_path: Path) -> None:
    proc = "9:name=systemd:/\n4:memory:/process_api/293f\n1:cpu:/\n0::/\n"
    files = {
        "memory/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/process_api/memory.limit_in_bytes": V1_UNLIMITED,
        "memory/process_api/293f/memory.limit_in_bytes": str(4 * GiB),
        "memory.max": str(GiB),  # not read: the memory controller is a v1 one
    }
    found = limit_of(tmp_path, proc, files)
    assert found is not None and found.nbytes == 4 * GiB
    assert found.what.endswith("/memory/process_api/293f/memory.limit_in_bytes)")


def test_v1_unlimited_is_none(tmp_path: Path) -> None:
    files = {"memory/memory.limit_in_bytes": V1_UNLIMITED}
    assert limit_of(tmp_path, "4:memory:/\n0::/\n", files) is None


def test_no_cgroup_file_or_nothing_readable_is_none(tmp_path: Path) -> None:
    assert cgroup_memory_limit(str(tmp_path / "absent"), str(tmp_path)) is None
    assert limit_of(tmp_path, "0::/a\n", {"a/memory.max": "lots"}) is None
    assert limit_of(tmp_path, "garbage\n", {}) is None


def test_mem_total_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683792 kB\nMemFree:         1000 kB\n")
    assert mem_total(str(meminfo)) == 24683792 * 1024


def test_available_memory_is_the_lower_of_the_cgroups_and_the_machines(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {32 * GiB // 1024} kB\n")
    write(tmp_path / "cgroup", {"a/memory.max": str(8 * GiB), "b/memory.max": str(64 * GiB)})
    for cgroup, expected in (("a", 8 * GiB), ("b", 32 * GiB), ("c", 32 * GiB)):
        (tmp_path / "proc_cgroup").write_text(f"0::/{cgroup}\n")
        found = available_memory(
            proc_cgroup=str(tmp_path / "proc_cgroup"),
            root=str(tmp_path / "cgroup"),
            meminfo=str(meminfo),
        )
        assert found.nbytes == expected, cgroup
        assert ("cgroup" in found.what) == (cgroup == "a")


def test_capacity_problem_names_the_limit() -> None:
    cgroup = MemoryLimit(4 * GiB, "the memory limit of its cgroup (/sys/fs/cgroup/x/memory.max)")
    assert capacity_problem(4 * GiB, cgroup) == ""
    assert capacity_problem(8 * GiB, cgroup) == (
        "cache.capacity 8.0GiB is more than the memory limit of its cgroup "
        "(/sys/fs/cgroup/x/memory.max), 4.0GiB"
    )
    assert capacity_problem(8 * GiB, MemoryLimit(0, "nothing says")) == ""


def test_check_config_warns_when_the_capacity_is_more_than_the_cgroup_allows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cgroup = MemoryLimit(4 * GiB, "the memory limit of its cgroup (/sys/fs/cgroup/x/memory.max)")
    monkeypatch.setattr(preflight, "available_memory", lambda: cgroup)
    monkeypatch.delenv("OFFLOADD_CACHE__CAPACITY", raising=False)
    assert cli.main(["check-config", "--capacity", "8GiB"]) == 0  # a warning, not a failure
    out, err = capsys.readouterr()
    assert "capacity = 8589934592  # 8.0GiB" in out.splitlines()
    assert err.startswith(
        "offloadd check-config: warning: cache.capacity 8.0GiB is more than the memory limit "
        "of its cgroup (/sys/fs/cgroup/x/memory.max), 4.0GiB: pre-faulting the arena"
    )
    assert len(err.splitlines()) == 1
    assert cli.main(["check-config", "--capacity", "4GiB", "--json"]) == 0
    assert capsys.readouterr().err == ""
