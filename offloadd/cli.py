"""The ``offloadd`` command line: ``serve``, ``status``, ``check-config``, ``demo``, ``events``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from offloadd import __version__
from offloadd.settings import (
    ENV_PREFIX,
    EventSettings,
    SettingsError,
    configure_logging,
    load_settings,
    settings_toml,
)

# Exit status for settings that do not load (a usage error, as argparse uses).
BAD_SETTINGS = 2


def _serve(args: argparse.Namespace) -> int:
    from offloadd.cache.arena import ArenaError
    from offloadd.daemon import run
    from offloadd.endpoint import EndpointInUse, EndpointRefused
    from offloadd.metrics import MetricsError

    overrides: dict[str, dict[str, Any]] = {}
    if args.endpoint:
        overrides.setdefault("server", {})["endpoint"] = args.endpoint
    if args.arena:
        overrides.setdefault("cache", {})["arena"] = args.arena
    if args.capacity:
        overrides.setdefault("cache", {})["capacity"] = args.capacity  # a size: "8GiB"
    if args.policy:
        overrides.setdefault("cache", {})["policy"] = args.policy
    if args.log_level:
        overrides.setdefault("log", {})["level"] = args.log_level
    if args.no_persist:
        overrides.setdefault("cache", {})["persist"] = False
    if args.events_endpoint is not None:
        overrides.setdefault("events", {})["endpoint"] = args.events_endpoint
    if args.events_replay_endpoint is not None:
        overrides.setdefault("events", {})["replay_endpoint"] = args.events_replay_endpoint
    if args.metrics_address is not None:
        overrides.setdefault("metrics", {})["address"] = args.metrics_address
    try:
        settings = load_settings(args.config, overrides=overrides)
    except SettingsError as exc:
        print(f"offloadd: {exc}", file=sys.stderr)
        return BAD_SETTINGS
    configure_logging(settings.log)
    try:
        run(settings)
    except (EndpointInUse, EndpointRefused, ArenaError, MetricsError) as exc:
        print(f"offloadd: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except SettingsError as exc:
        print(f"offloadd check-config: {exc}", file=sys.stderr)
        return BAD_SETTINGS
    if args.json:
        encoded = msgspec.json.encode(settings)
        sys.stdout.write(msgspec.json.format(encoded, indent=2).decode() + "\n")
        return 0
    sources = ["built-in defaults"]
    if args.config:
        sources.append(args.config)
    sources += sorted(name for name in os.environ if name.startswith(ENV_PREFIX))
    sys.stdout.write(f"# offloadd settings from: {', '.join(sources)}\n")
    sys.stdout.write(settings_toml(settings))
    return 0


def _status(args: argparse.Namespace) -> int:
    from offloadd.status import main as status_main

    endpoint = args.endpoint
    if not endpoint:
        try:
            endpoint = load_settings(args.config).endpoint()
        except SettingsError as exc:
            print(f"offloadd status: {exc}", file=sys.stderr)
            return BAD_SETTINGS
    return status_main(endpoint, as_json=args.json, timeout=args.timeout)


def _demo(args: argparse.Namespace) -> int:
    from offloadd.demo import main as demo_main

    logging.basicConfig(level=logging.WARNING)
    return demo_main(
        args.endpoint,
        engines=args.engines,
        tp=args.tp,
        chunks=args.chunks,
        seed=args.seed,
        phase=args.phase,
        as_json=args.json,
        events=args.events,
    )


def _events(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=(args.log_level or "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(
            _watch_events(args.endpoint, args.replay or None, topic=args.topic, as_json=args.json)
        )
    except KeyboardInterrupt:  # arrived before the signal handlers were installed
        return 0


async def _watch_events(endpoint: str, replay: str | None, *, topic: str, as_json: bool) -> int:
    """Print events until SIGINT/SIGTERM (or until the output goes away)."""
    from offloadd.subscriber import Subscriber, event_lines, event_records

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    async def show(subscriber: Subscriber) -> None:
        async for received in subscriber:
            if as_json:
                for record in event_records(received):
                    sys.stdout.write(msgspec.json.encode(record).decode() + "\n")
            else:
                for line in event_lines(received):
                    sys.stdout.write(line + "\n")
            sys.stdout.flush()

    async with Subscriber(endpoint, replay, topic=topic) as subscriber:
        printer = asyncio.create_task(show(subscriber))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({printer, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for task in (printer, stopper):
            task.cancel()
        await asyncio.gather(printer, stopper, return_exceptions=True)
    exc = None if printer.cancelled() else printer.exception()
    if isinstance(exc, BrokenPipeError):  # the reader went away (| head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    elif exc is not None:
        raise exc
    return 0


def _bench(args: argparse.Namespace) -> int:
    from offloadd.bench import main as bench_main

    argv = ["--quick"] if args.quick else []
    if args.json:
        argv += ["--json", args.json]
    for name in args.only or []:
        argv += ["--only", name]
    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="offloadd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"offloadd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the daemon (built-in defaults need no file)")
    serve.add_argument("--config", help="TOML settings file")
    serve.add_argument(
        "--endpoint", help="control endpoint, e.g. ipc:///run/offloadd/offloadd.sock"
    )
    serve.add_argument("--arena", help="arena file (default /dev/shm/offloadd-<uid>.arena)")
    serve.add_argument("--capacity", help="arena size, e.g. 8GiB (default 1GiB)")
    serve.add_argument("--policy", choices=["lru", "arc"], help="eviction policy")
    serve.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    serve.add_argument(
        "--no-persist",
        action="store_true",
        help="remove the arena and its journal at exit (default: keep them for a warm restart)",
    )
    serve.add_argument(
        "--events-endpoint", help="KV events PUB endpoint (default tcp://127.0.0.1:5557)"
    )
    serve.add_argument(
        "--events-replay-endpoint",
        help="KV events replay ROUTER endpoint (default tcp://127.0.0.1:5558; '' disables)",
    )
    serve.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        help="Prometheus /metrics address (default 127.0.0.1:9464; '' disables)",
    )
    serve.set_defaults(handler=_serve)

    status = commands.add_parser(
        "status",
        help="show a running daemon: engines, sessions, cache fill, hits, bytes moved",
        description="Ask a running daemon for its counters. Exits 1 when no daemon answers.",
    )
    status.add_argument("--endpoint", help="control endpoint (default: the one the settings give)")
    status.add_argument("--config", help="settings file to take the endpoint from")
    status.add_argument("--json", action="store_true", help="print the stats as JSON")
    status.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for an answer (default 3)"
    )
    status.set_defaults(handler=_status)

    check = commands.add_parser(
        "check-config",
        help="validate the settings (file and OFFLOADD_* environment) and print them",
        description="Load the settings as `offloadd serve` would (built-in defaults < --config "
        "file < OFFLOADD_<SECTION>__<KEY> environment) and print the result. Exits 2 "
        "naming the setting and its source when something is wrong.",
    )
    check.add_argument("--config", help="TOML settings file")
    check.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    check.set_defaults(handler=_check_config)

    demo = commands.add_parser("demo", help="simulate engines against a daemon, verify bytes")
    demo.add_argument("--endpoint", help="use this running daemon instead of starting one")
    demo.add_argument("--engines", type=int, default=2)
    demo.add_argument("--tp", type=int, default=2)
    demo.add_argument("--chunks", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--phase", choices=["store", "load", "both"], default="both")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument(
        "--events",
        help="KV events endpoint to watch (default: the demo's own daemon; with --endpoint: "
        "tcp://127.0.0.1:5557, replay on port + 1; 'none' to skip)",
    )
    demo.set_defaults(handler=_demo)

    event_defaults = EventSettings()
    events = commands.add_parser(
        "events",
        help="print KV-cache events from a daemon or a vLLM engine, one line per event",
        description="Subscribe to KV-cache events (vLLM's ZMQ protocol): replays what the "
        "publisher still buffers, then follows live, filling gaps from replay. Stops "
        "cleanly on Ctrl-C or SIGTERM.",
    )
    events.add_argument(
        "--endpoint",
        default=event_defaults.endpoint,
        help=f"PUB endpoint to subscribe to (default {event_defaults.endpoint})",
    )
    events.add_argument(
        "--replay",
        default=event_defaults.replay_endpoint,
        help=f"replay endpoint (default {event_defaults.replay_endpoint}; '' for none)",
    )
    events.add_argument("--topic", default="", help="topic prefix (default: every topic)")
    events.add_argument("--json", action="store_true", help="one JSON object per event")
    events.add_argument("--log-level", help="DEBUG, INFO, WARNING (default), ...")
    events.set_defaults(handler=_events)
    bench = commands.add_parser(
        "bench", help="benchmarks: daemon vs same-run baselines, printed as ratios"
    )
    bench.add_argument("--quick", action="store_true", help="the short run (< 5 minutes)")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.add_argument("--only", action="append", metavar="NAME", help="run only this group")
    bench.set_defaults(handler=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``offloadd`` console script."""
    args = build_parser().parse_args(argv)
    handler = args.handler
    status = handler(args)
    assert isinstance(status, int)
    return status
