"""``offloadd cache ls`` and ``offloadd cache clear``: see and drop what a running daemon caches.

Both ask the daemon over its control socket (``ListCache``, ``ClearCache`` in
``protocol.messages``); only root and the daemon's user may (a member of the socket's group
is refused, and told so). Imported when the command line starts, so it imports the client
only when a command runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO, TypeVar

import msgspec

from offloadd import cli_values as values
from offloadd.settings import SettingsError, format_size, load_settings

if TYPE_CHECKING:
    from offloadd.client import OffloadClient
    from protocol.messages import CacheListing

__all__ = ["add_command", "describe", "main_clear", "main_ls"]

BAD_SETTINGS = 2
T = TypeVar("T")


def add_command(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``cache ls`` and ``cache clear`` by the command line's ``add_parser``."""
    cache = add_parser(
        "cache",
        help="list what a running daemon caches per namespace and engine, or drop it",
        description="See or drop what a running daemon caches. Root and the daemon's user "
        "only. Exits 1 when no daemon answers or it refuses.",
    )
    actions = cache.add_subparsers(dest="cache_command", required=True)
    ls = actions.add_parser(
        "ls",
        help="namespaces and engines: chunks, bytes, hits, misses, last use",
        description="List each namespace (engines of one model, geometry and tenant share "
        "one) with its chunks, bytes, hits and misses since the daemon started and its last "
        "use, then each engine, connected or not since the start, with its own.",
    )
    _daemon_flags(ls)
    ls.add_argument("--json", action="store_true", help="print the listing as JSON")
    ls.set_defaults(handler=main_ls)
    clear = actions.add_parser(
        "clear",
        help="drop the chunks of an engine, a namespace, or all",
        description="Drop cached chunks now. Engines keep running and miss those keys (they "
        "recompute them); routers hear each removal as a BlockRemoved KV event. An engine's "
        "chunks are its namespace's: engines sharing it lose them too. The arena's memory "
        "stays mapped; docs/operations.md says how to give it back.",
    )
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("--engine", metavar="ENGINE_ID", help="the namespace this engine uses")
    which.add_argument("--namespace", metavar="NAME", help="this namespace (cache ls names it)")
    which.add_argument("--all", action="store_true", help="every chunk of every namespace")
    _daemon_flags(clear)
    clear.set_defaults(handler=main_clear)


def _daemon_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint", type=values.endpoint, help="control endpoint (default: the settings')"
    )
    parser.add_argument(
        "--config", type=values.settings_file, help="settings file to take the endpoint from"
    )
    parser.add_argument(
        "--timeout", type=values.seconds, default=10.0, help="seconds to wait (default 10)"
    )


def main_ls(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``offloadd cache ls``."""
    out = out or sys.stdout
    try:
        listing = _ask(args, "ls", lambda client: client.list_cache())
    except _Failed as failed:
        return failed.status
    if args.json:
        out.write(msgspec.json.format(msgspec.json.encode(listing), indent=2).decode() + "\n")
    else:
        out.write("\n".join(describe(listing, now=time.time())) + "\n")
    return 0


def main_clear(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``offloadd cache clear``."""
    out = out or sys.stdout
    namespace, engine = args.namespace or "", args.engine or ""
    try:
        dropped = _ask(
            args,
            "clear",
            lambda client: client.clear_cache(all=args.all, namespace=namespace, engine_id=engine),
        )
    except _Failed as failed:
        return failed.status
    what = (
        "every namespace"
        if args.all
        else f"namespace {namespace}"
        if namespace
        else f"the namespace of engine {engine}"
    )
    out.write(f"offloadd cache clear: dropped {dropped} chunks ({what})\n")
    return 0


class _Failed(Exception):
    """The command failed after saying why; ``status`` is its exit status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _ask(args: argparse.Namespace, what: str, call: Callable[[OffloadClient], T]) -> T:
    """``call`` on a client of the daemon ``--endpoint`` (or the settings) names."""
    prog = f"offloadd cache {what}"
    endpoint = args.endpoint
    if endpoint is None:
        try:
            endpoint = load_settings(args.config).endpoint()
        except SettingsError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            raise _Failed(BAD_SETTINGS) from None
    from offloadd.client import OffloadClient
    from offloadd.errors import DaemonUnavailable, OffloaddError

    try:
        with OffloadClient(endpoint, timeout=args.timeout, heartbeat=0) as client:
            return call(client)
    except DaemonUnavailable:
        print(
            f"{prog}: no daemon answers at {endpoint} (is it running? see systemctl status "
            "offloadd)",
            file=sys.stderr,
        )
    except OffloaddError as exc:  # refused (not root or the daemon's user), or failed
        print(f"{prog}: {endpoint}: {exc}", file=sys.stderr)
    raise _Failed(1)


def describe(listing: CacheListing, *, now: float) -> list[str]:
    """The listing as two tables for a terminal."""
    rows = [["NAMESPACE", "TENANT", "CHUNKS", "BYTES", "HITS", "MISSES", "LAST USE", "ENGINES"]]
    for ns in listing.namespaces:
        rows.append(
            [
                ns.name,
                ns.tenant or "-",
                str(ns.chunks),
                format_size(ns.nbytes),
                str(ns.hits),
                str(ns.misses),
                _ago(ns.last_use, now),
                ", ".join(ns.engines) or "-",
            ]
        )
    lines = _table(rows) if listing.namespaces else ["no namespace holds chunks"]
    chunks = {ns.name: ns for ns in listing.namespaces}
    rows = [["ENGINE", "DP", "NAMESPACE", "CONNECTED", "CHUNKS", "HITS", "MISSES", "LAST USE"]]
    for engine in listing.engines:
        held = chunks.get(engine.namespace)
        rows.append(
            [
                engine.engine_id,
                str(engine.data_parallel_index),
                engine.namespace or "-",
                "yes" if engine.connected else "no",
                str(held.chunks) if held else "0",
                str(engine.hits),
                str(engine.misses),
                _ago(engine.last_use, now),
            ]
        )
    lines.append("")
    lines += _table(rows) if listing.engines else ["no engine since the daemon started"]
    return lines


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _ago(when: float, now: float) -> str:
    """``2026-05-01 12:00:00 (3m ago)`` in local time; ``never`` for 0."""
    if not when:
        return "never"
    seconds = max(0, int(now - when))
    ago = (
        f"{seconds}s"
        if seconds < 60
        else f"{seconds // 60}m"
        if seconds < 3600
        else f"{seconds // 3600}h"
        if seconds < 86400
        else f"{seconds // 86400}d"
    )
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))} ({ago} ago)"
