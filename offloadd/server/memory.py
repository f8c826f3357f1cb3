"""How much memory the arena may take here: the memory limit of this process's cgroup where
there is one, else the machine's ``MemTotal``.

The arena's pages (tmpfs, pre-faulted at start) are charged to the cgroup of the process that
faults them, so a capacity above the cgroup's limit gets the daemon OOM-killed while it
pre-faults, however much memory the machine has. ``cgroup_memory_limit`` reads the limit from
the files themselves (paths given, so tests use fake ones): cgroup v2's ``memory.max``, or
v1's ``memory.limit_in_bytes`` where the memory controller is mounted as v1 (hybrid hosts),
of the process's own cgroup (``/proc/self/cgroup``) and each of its ancestors up to the mount,
the lowest one counting (a parent's limit holds its children too). In a container whose
``/proc/self/cgroup`` names a path the mount does not show (no cgroup namespace), the mount's
root is the container's own cgroup, and is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offloadd.settings import physical_memory

__all__ = ["MemoryLimit", "available_memory", "cgroup_memory_limit", "mem_total"]

# cgroup v1 says "no limit" with a huge number (PAGE_COUNTER_MAX pages: 9223372036854771712
# bytes with 4 KiB pages); anything this large is no limit.
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """``nbytes`` of memory, and where the figure comes from (``what`` names it for people)."""

    nbytes: int
    what: str


def cgroup_memory_limit(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> MemoryLimit | None:
    """The memory limit of the cgroup ``proc_cgroup`` names, cgroups mounted at ``root``;
    None where there is none (no limit set, no cgroup file system, not Linux)."""
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    v1: tuple[str, str] | None = None
    v2: str | None = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep:
            continue
        if "memory" in controllers.split(","):
            v1 = controllers, path
        elif hierarchy == "0" and not controllers:
            v2 = path
    if v1 is not None:  # the memory controller is a v1 one: v2's hierarchy has none
        controllers, path = v1
        for mount in (os.path.join(root, "memory"), os.path.join(root, controllers)):
            if os.path.isdir(mount):
                return _lowest(mount, path, "memory.limit_in_bytes")
        return None
    if v2 is not None:
        return _lowest(root, v2, "memory.max")
    return None


def _lowest(mount: str, path: str, name: str) -> MemoryLimit | None:
    """The lowest limit in the files ``name`` of cgroup ``path`` and its ancestors."""
    parts = [part for part in path.split("/") if part]
    found: MemoryLimit | None = None
    for depth in range(len(parts), -1, -1):
        where = os.path.join(mount, *parts[:depth], name)
        limit = _read_limit(where)
        if limit is not None and (found is None or limit < found.nbytes):
            found = MemoryLimit(limit, f"the memory limit of its cgroup ({where})")
    return found


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (v2: no limit), or nothing this code understands
        return None
    value = int(text)
    return value if value < _UNLIMITED else None


def mem_total(meminfo: str = "/proc/meminfo") -> int:
    """``MemTotal`` in bytes (the system's page count where there is no such file; 0 when
    neither says)."""
    try:
        with open(meminfo) as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key == "MemTotal":  # "MemTotal:       24683792 kB"
                    number, *unit = rest.split()
                    return int(number) * (1024 if unit == ["kB"] else 1)
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory()


def available_memory(
    *,
    proc_cgroup: str = "/proc/self/cgroup",
    root: str = "/sys/fs/cgroup",
    meminfo: str = "/proc/meminfo",
) -> MemoryLimit:
    """The memory the arena may take: the cgroup's limit, or ``MemTotal`` where that is
    lower or there is none (``nbytes`` 0 when nothing says)."""
    machine = MemoryLimit(mem_total(meminfo), "this machine's memory (MemTotal)")
    cgroup = cgroup_memory_limit(proc_cgroup, root)
    if cgroup is not None and (not machine.nbytes or cgroup.nbytes < machine.nbytes):
        return cgroup
    return machine
