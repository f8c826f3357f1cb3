"""No daemon module announces an eviction itself (issue 44): the cache tells its listener.

A source scan of ``offloadd/server``: no call of ``chunks_removed`` (the announcer's old entry
point) and no call of an announcer's ``removed`` but the cache's listener's own (the
committer, which journals the tombstones, then has them told). The scan itself is shown to
catch both.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "offloadd" / "server"


def announcing_calls(source: str) -> list[str]:
    """The calls in ``source`` that tell of removals past the cache: each as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, receiver = node.func.attr, ast.unparse(node.func.value)
        if name == "chunks_removed" or (name == "removed" and "announce" in receiver.lower()):
            found.append(ast.unparse(node.func))
    return found


def test_no_server_module_announces_removals_the_cache_made() -> None:
    calls = {
        str(path.relative_to(SERVER)): found
        for path in sorted(SERVER.rglob("*.py"))
        if (found := announcing_calls(path.read_text()))
    }
    listener = {"commit.py": ["self._announce.removed"]}  # Committer.removed, the listener
    assert calls == listener, f"evictions are the cache's listener's to announce: {calls}"


def test_the_scan_catches_both_names() -> None:
    source = """
def store(self, cache, keys):
    reservation = cache.begin_store("ns", keys, 0, sizes)
    self._announce.chunks_removed(reservation.evicted)
    announcer.removed(reservation.evicted)
    self._journal.removed(reservation.evicted)  # the journal's own: not an announcement
"""
    assert announcing_calls(source) == ["self._announce.chunks_removed", "announcer.removed"]
