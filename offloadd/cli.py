"""The ``offloadd`` command line: ``serve``, ``status``, ``cache``, ``check-config``, ``demo``,
``events``, ``bench``, ``check-gpu``, ``install`` (``cache`` and ``install`` have modules of
their own: ``offloadd.cache_admin``, ``offloadd.install``).

A value a command cannot use is a usage error, reported before anything starts: one line on
stderr that names the flag (or the setting and where its value came from) and exit status 2.
The flags that set a setting (``serve`` and ``check-config`` share them, ``SETTINGS_FLAGS``)
take exactly what the setting takes, ``""`` included (its meaning is the setting's, see
``offloadd.settings``); elsewhere an empty value is an error unless its help says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import select
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import msgspec

from offloadd import __version__, cache_admin, install
from offloadd import cli_values as values
from offloadd.settings import (
    ENV_PREFIX,
    SETTINGS_SECTIONS,
    Settings,
    SettingsError,
    configure_logging,
    load_settings,
    settings_toml,
)

logger = logging.getLogger(__name__)

# Exit status for values that cannot be used (a usage error, as argparse uses).
BAD_SETTINGS = 2
# Exit status when the reader of stdout went away (``| head -1``): 128 + SIGPIPE, what a
# shell reports for ``yes | head -1``'s ``yes``. Not 0: the output was cut short, and a
# script under ``set -o pipefail`` should see it as it sees any other tool's.
BROKEN_PIPE = 128 + signal.SIGPIPE

# The flags that set a setting, shared by serve and check-config: flag -> (section, key, help).
SETTINGS_FLAGS: dict[str, tuple[str, str, str]] = {
    "--endpoint": (
        "server",
        "endpoint",
        "control endpoint, e.g. ipc:///run/offloadd/offloadd.sock ('' = the default socket "
        "in the runtime directory)",
    ),
    "--arena": ("cache", "arena", "arena file ('' = /dev/shm/offloadd-<uid>/arena)"),
    "--journal": (
        "cache",
        "journal",
        "commit journal ('' = <state dir>/<arena name>.journal; its key beside it)",
    ),
    "--capacity": ("cache", "capacity", "arena size, e.g. 8GiB or 8GB (default 1GiB)"),
    "--policy": ("cache", "policy", "eviction policy: lru (default) or arc"),
    "--log-level": ("log", "level", "DEBUG, INFO (default), WARNING, ..."),
    "--events-endpoint": (
        "events",
        "endpoint",
        "KV events PUB endpoint (default auto: ipc://SOCKET.events beside the control "
        "socket; tcp://HOST:PORT explicitly; '' turns events off)",
    ),
    "--events-replay-endpoint": (
        "events",
        "replay_endpoint",
        "KV events replay ROUTER endpoint (default auto: ipc://SOCKET.replay, the next port "
        "beside a tcp events endpoint; '' disables replay)",
    ),
    "--metrics-address": (
        "metrics",
        "address",
        "Prometheus /metrics address HOST:PORT or unix:/PATH (default auto: "
        "unix:SOCKET.metrics beside the control socket, 0600; '' turns it off)",
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line: the command, the flag and the problem."""

    commands: Mapping[str, argparse.ArgumentParser]  # the subcommands' parsers, by name
    # An epilog made when help is printed (the bench's groups: importing the bench would
    # cost every other command, a daemon that dropped its privileges included).
    lazy_epilog: Callable[[], str] | None = None

    def format_help(self) -> str:
        """The help, with ``lazy_epilog`` made now."""
        if self.lazy_epilog is not None:
            self.epilog, self.lazy_epilog = self.lazy_epilog(), None
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with status 2."""
        self.exit(BAD_SETTINGS, f"{self.prog}: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------- settings


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=values.settings_file, help="TOML settings file")
    for flag, (_section, _key, text) in SETTINGS_FLAGS.items():
        parser.add_argument(flag, help=text)
    parser.add_argument(
        "--no-persist",
        action="store_true",
        help="remove the arena and its journal at exit (default: keep them for a warm restart)",
    )


def _flag_settings(args: argparse.Namespace) -> dict[str, dict[str, tuple[Any, str]]]:
    """The settings the flags of ``args`` give, each with its flag (the error's source)."""
    flags: dict[str, dict[str, tuple[Any, str]]] = {}
    for flag, (section, key, _text) in SETTINGS_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            flags.setdefault(section, {})[key] = (value, flag)
    if getattr(args, "no_persist", False):
        flags.setdefault("cache", {})["persist"] = (False, "--no-persist")
    return flags


def _settings(args: argparse.Namespace, prog: str, *, flags: bool = False) -> Settings | None:
    """The settings that ``--config``, the environment and (with ``flags``) the settings
    flags of ``args`` give; None after printing why they don't load."""
    try:
        return load_settings(args.config, flags=_flag_settings(args) if flags else None)
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


# --------------------------------------------------------------------------- commands


def _serve(args: argparse.Namespace) -> int:
    settings = _settings(args, "offloadd", flags=True)
    if settings is None:
        return BAD_SETTINGS
    import zmq

    from offloadd.cache.arena import ArenaError
    from offloadd.cache.journal import JournalError
    from offloadd.endpoint import EndpointInUse, EndpointRefused
    from offloadd.safety import UnsafePath
    from offloadd.server.metrics import MetricsError
    from offloadd.server.preflight import PreflightError
    from offloadd.server.process import run
    from offloadd.server.publisher import EventBindError

    configure_logging(settings.log)
    try:
        status = run(settings, reload=lambda: _reloaded(args), source=args.config or "")
    except (
        EndpointInUse,
        EndpointRefused,
        ArenaError,
        JournalError,
        MetricsError,
        EventBindError,
        PreflightError,
        UnsafePath,
    ) as exc:
        print(f"offloadd: {exc}", file=sys.stderr)
        return 1
    except (zmq.ZMQError, OSError, ValueError) as exc:
        # What the environment refuses at start (a port in use, a directory that may not be
        # created, a key file that holds no key): one line; the traceback at DEBUG.
        logger.debug("offloadd serve failed", exc_info=True)
        print(f"offloadd: {exc} (serving {settings.endpoint()})", file=sys.stderr)
        return 1
    if status:
        # A forced exit: copies may still run on the engine's threads, which the interpreter
        # would join at exit; the socket and locks are gone already.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return 0


def _reloaded(args: argparse.Namespace) -> Settings:
    """The settings ``serve`` reads again on SIGHUP: the file once more, under the environment
    and flags it started with. Raises SettingsError."""
    return load_settings(args.config, flags=_flag_settings(args))


def _check_config(args: argparse.Namespace) -> int:
    settings = _settings(args, "offloadd check-config", flags=True)
    if settings is None:
        return BAD_SETTINGS
    if args.preflight:
        return _preflight(settings)
    from offloadd.server.preflight import capacity_problem

    problem = capacity_problem(settings.cache.capacity)
    if problem:  # only a warning: the file may be meant for another machine
        sys.stderr.write(
            f"offloadd check-config: warning: {problem}: pre-faulting the arena would run "
            "out of memory here, where the OOM killer picks the daemon (--preflight fails "
            "on it)\n"
        )
    if args.json:
        encoded = msgspec.json.encode(settings)
        sys.stdout.write(msgspec.json.format(encoded, indent=2).decode() + "\n")
        return 0
    sources = ["built-in defaults"]
    if args.config:
        sources.append(args.config)
    sources += sorted(name for name in os.environ if name.startswith(ENV_PREFIX))
    sources += [flag for section in _flag_settings(args).values() for _, flag in section.values()]
    sys.stdout.write(f"# offloadd settings from: {', '.join(sources)}\n")
    sys.stdout.write(settings_toml(settings))
    return 0


def _preflight(settings: Settings) -> int:
    from offloadd.server.preflight import preflight

    checks = preflight(settings)
    for check in checks:
        mark = "ok  " if check.ok else "FAIL"
        sys.stdout.write(
            f"{mark} {check.what}" + (f": {check.problem}" if check.problem else "") + "\n"
        )
    failed = sum(not check.ok for check in checks)
    if failed:
        sys.stderr.write(f"offloadd check-config: {failed} of {len(checks)} checks failed\n")
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    from offloadd.status import main as status_main

    endpoint = args.endpoint
    if endpoint is None:
        settings = _settings(args, "offloadd status")
        if settings is None:
            return BAD_SETTINGS
        endpoint = settings.endpoint()
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
        level=args.log_level or "WARNING",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from offloadd.endpoint import replay_beside

    endpoint, replay = args.endpoint, args.replay
    if endpoint is None:
        found = _daemon_events(args)
        if isinstance(found, int):
            return found
        endpoint, advertised = found
        replay = advertised if replay is None else replay
    elif replay is None:
        replay = replay_beside(endpoint)
    try:
        return asyncio.run(
            _watch_events(endpoint, replay or None, topic=args.topic, as_json=args.json)
        )
    except KeyboardInterrupt:  # arrived before the signal handlers were installed
        return 0


def _daemon_events(args: argparse.Namespace) -> tuple[str, str] | int:
    """Ask the daemon (``--daemon``, else the endpoint the settings give) where its events
    are: ``(endpoint, replay)``, or an exit status after saying why not."""
    from offloadd.errors import DaemonUnavailable
    from offloadd.status import fetch_stats

    control = args.daemon
    if control is None:
        settings = _settings(args, "offloadd events")
        if settings is None:
            return BAD_SETTINGS
        control = settings.endpoint()
    try:
        stats = fetch_stats(control)
    except DaemonUnavailable:
        print(
            f"offloadd events: no daemon answers at {control}; give --daemon ENDPOINT, or "
            "--endpoint to subscribe to a publisher directly",
            file=sys.stderr,
        )
        return 1
    if not stats.events_endpoint:
        print(
            f"offloadd events: the daemon at {control} publishes no KV events "
            '(events.enabled = false or events.endpoint = "")',
            file=sys.stderr,
        )
        return 1
    replay = stats.events_replay_endpoint
    print(
        f"offloadd events: {stats.events_endpoint} (replay {replay or 'none'}), "
        f"from the daemon at {control}",
        file=sys.stderr,
    )
    return stats.events_endpoint, replay


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
    if exc is not None:
        raise exc  # a BrokenPipeError too: main ends the command quietly
    return 0


def _bench(args: argparse.Namespace) -> int:
    from offloadd.bench import main as bench_main

    argv = ["--quick"] if args.quick else ["--smoke"] if args.smoke else []
    if args.json:
        argv += ["--json", args.json]
    if args.only:
        argv += ["--only", *args.only]
    return bench_main(argv)


def _check_gpu(args: argparse.Namespace) -> int:
    from offloadd import gpu_check

    fields = gpu_check.Options.__dataclass_fields__  # the flags' dests, by name
    options = gpu_check.Options(**{k: v for k, v in vars(args).items() if k in fields})
    return gpu_check.main(options)


OVERVIEW = """\
offloadd keeps a node's KV cache in host memory for the inference engines (vLLM) on it.
Run one daemon per GPU node; engines connect to its socket through the plugin.

  offloadd serve                      run the daemon (works with no settings file)
  offloadd check-config --preflight   check the settings and this machine before serving
  offloadd status                     what the running daemon holds, serves and refuses
  offloadd cache ls | clear           what it caches per namespace and engine; drop it
  offloadd demo                       a daemon and simulated engines moving real bytes
  offloadd events                     follow the KV-cache events routers receive
  offloadd bench                      measure it against same-run baselines
  offloadd check-gpu                  the CUDA path end to end on this GPU host, verified
  offloadd install                    set up this node: user, group, venv, unit, settings

Settings come from built-in defaults < --config FILE (TOML) < OFFLOADD_<SECTION>__<KEY>
environment variables < flags. systemd/offloadd.toml lists every setting at its default.
"""

SETTINGS_EPILOG = """\
Settings without a flag ({count}) are set in the --config file or as OFFLOADD_<SECTION>__<KEY>
environment variables, e.g. OFFLOADD_SERVER__COPY_ENGINE=cuda: {names}.
Sizes take units: 8GiB (binary), 8GB (decimal: 8e9 bytes); a bare 8G is refused. "" means
the setting's default or "off", as each says: docs/settings.md gives every setting's meaning.
"""


def _completion(args: argparse.Namespace) -> int:
    from offloadd.completion import script

    sys.stdout.write(script(build_parser(), args.shell))
    return 0


def _settings_epilog() -> str:
    flagged = {(section, key) for section, key, _help in SETTINGS_FLAGS.values()}
    names = [
        f"{section}.{key}"
        for section, struct in sorted(SETTINGS_SECTIONS.items())
        for key in struct.__struct_fields__
        if (section, key) not in flagged
    ]
    return SETTINGS_EPILOG.format(count=len(names), names=", ".join(names))


def _bench_groups() -> str:
    from offloadd.bench import ELSEWHERE, groups_help

    return f"{groups_help()}\n\n{ELSEWHERE[0].upper()}{ELSEWHERE[1:]}"


def build_parser() -> _Parser:
    """The argument parser (exposed for tests and docs)."""
    parser = _Parser(
        prog="offloadd",
        description=OVERVIEW,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"offloadd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.commands = commands.choices  # filled in as each command is added below

    serve = commands.add_parser(
        "serve",
        help="run the daemon (built-in defaults need no file)",
        description="Run the daemon in the foreground until SIGTERM or SIGINT (a second one "
        "ends the drain at once); SIGHUP reads --config again and applies the log's level and "
        "format, and logs which changed settings wait for a restart. Every port, directory "
        "and the arena's room are checked before the arena is pre-faulted; a start that "
        "fails says which setting and exits 1.",
        epilog=_settings_epilog(),
    )
    _add_settings_flags(serve)
    serve.set_defaults(handler=_serve)

    status = commands.add_parser(
        "status",
        help="show a running daemon: engines, sessions, cache fill, hits, bytes moved, events",
        description="Ask a running daemon for its counters. Exits 1 when no daemon answers.",
    )
    status.add_argument(
        "--endpoint",
        type=values.endpoint,
        help="control endpoint (default: the one the settings give)",
    )
    status.add_argument(
        "--config", type=values.settings_file, help="settings file to take the endpoint from"
    )
    status.add_argument("--json", action="store_true", help="print the stats as JSON")
    status.add_argument(
        "--timeout",
        type=values.seconds,
        default=3.0,
        help="seconds to wait for an answer (default 3)",
    )
    status.set_defaults(handler=_status)
    cache_admin.add_command(commands.add_parser)
    install.add_command(commands.add_parser)

    check = commands.add_parser(
        "check-config",
        help="validate the settings (file, OFFLOADD_* environment, flags) and print them",
        description="Load the settings as `offloadd serve` would with the same flags "
        "(built-in defaults < --config file < OFFLOADD_<SECTION>__<KEY> environment < "
        "flags) and print the result. Exits 2 naming the setting and its source when "
        "something is wrong.",
    )
    _add_settings_flags(check)
    check.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    check.add_argument(
        "--preflight",
        action="store_true",
        help="also run every check serve runs before serving, on this machine: bind and "
        "release the ports, check the socket, arena, journal and disk directories, the "
        "arena's room and the copy engine; exit status 0 only when serve would start",
    )
    check.set_defaults(handler=_check_config)

    demo = commands.add_parser("demo", help="simulate engines against a daemon, verify bytes")
    demo.add_argument(
        "--endpoint", type=values.endpoint, help="use this running daemon instead of starting one"
    )
    demo.add_argument("--engines", type=values.integer(1), default=2, help="engines (default 2)")
    demo.add_argument(
        "--tp", type=values.integer(1), default=2, help="ranks per engine (default 2)"
    )
    demo.add_argument("--chunks", type=values.integer(1), default=64, help="chunks (default 64)")
    demo.add_argument("--seed", type=values.integer(0), default=0, help="seed of keys and bytes")
    demo.add_argument("--phase", choices=["store", "load", "both"], default="both")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument(
        "--events",
        type=values.endpoint_or_none,
        help="KV events endpoint to watch (default: where the daemon says it publishes; "
        "a tcp:// endpoint given here is replayed from port + 1); 'none' to skip",
    )
    demo.set_defaults(handler=_demo)

    events = commands.add_parser(
        "events",
        help="print KV-cache events from a daemon or a vLLM engine, one line per event",
        description="Subscribe to KV-cache events (vLLM's ZMQ protocol): replays what the "
        "publisher still buffers, then follows live, filling gaps from replay. Stops "
        "cleanly on Ctrl-C or SIGTERM. Without --endpoint it asks the daemon (--daemon, "
        "else the control endpoint the settings give) where its events are.",
    )
    events.add_argument(
        "--endpoint",
        type=values.endpoint,
        help="PUB endpoint to subscribe to (default: the daemon's)",
    )
    events.add_argument(
        "--replay",
        type=values.endpoint_or_empty,
        help="replay endpoint (default: the daemon's; with a tcp:// --endpoint, its port + 1; "
        "'' for none)",
    )
    events.add_argument(
        "--daemon",
        type=values.endpoint,
        metavar="ENDPOINT",
        help="control endpoint of the daemon to ask (default: the one the settings give)",
    )
    events.add_argument(
        "--config",
        type=values.settings_file,
        help="settings file to take the daemon's endpoint from",
    )
    events.add_argument("--topic", default="", help="topic prefix (default '': every topic)")
    events.add_argument("--json", action="store_true", help="one JSON object per event")
    events.add_argument(
        "--log-level", type=values.log_level, help="DEBUG, INFO, WARNING (default), ..."
    )
    events.set_defaults(handler=_events)

    bench = commands.add_parser(
        "bench",
        help="benchmarks: daemon vs same-run baselines, printed as ratios",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.lazy_epilog = _bench_groups
    size = bench.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="fewer repetitions (about 7 minutes on a 2-core VM)"
    )
    size.add_argument(
        "--smoke",
        action="store_true",
        help="every group at a tiny size, to check that each runs (not to measure); exit "
        "status 1 names the groups that failed",
    )
    bench.add_argument(
        "--json", type=values.output_file, metavar="FILE", help="also write the results as JSON"
    )
    bench.add_argument(
        "--only",
        type=values.bench_name,
        action="append",
        metavar="NAME",
        help="run only this group (listed below) or these results (a name pattern such as "
        "shm_*_1MiB)",
    )
    bench.set_defaults(handler=_bench)

    gpu = commands.add_parser(
        "check-gpu",
        help="the CUDA path end to end on this GPU host: stores and loads verified byte for "
        "byte, GB/s next to a torch copy_ baseline",
        description="offloadd's CUDA path end to end: a real daemon (copy engine cuda) on a "
        "thread, two rank processes on GPU 0 registering CUDA KV tensors over IPC, stores and "
        "loads verified byte for byte, GB/s next to a torch copy_ baseline measured in the "
        "same run, job latency. Exit status 0 when every byte matched on a pinned, batched "
        "copy path; 1 otherwise; 2 without CUDA (or for a bad flag).",
    )
    gpu.add_argument(
        "--total",
        type=values.size(1),
        metavar="SIZE",
        default="4GiB",
        help="bytes stored (and loaded), both ranks (default 4GiB)",
    )
    gpu.add_argument(
        "--layers", type=values.integer(1), metavar="N", default=32, help="KV layers per rank (32)"
    )
    gpu.add_argument(
        "--page",
        type=values.size(1),
        metavar="SIZE",
        default="64KiB",
        help="bytes moved per block per layer (default 64KiB; odd sizes such as 18KiB, 40KiB, "
        "61KiB work)",
    )
    gpu.add_argument(
        "--pad",
        type=values.size(0),
        metavar="SIZE",
        default="4KiB",
        help="padding after each block's page, never copied (default 4KiB)",
    )
    gpu.add_argument(
        "--arena",
        type=values.size(1),
        metavar="SIZE",
        default=0,
        help="arena size (default: --total plus slack); above 64GiB the arena is pinned in "
        "several pieces (needs that much /dev/shm and RAM)",
    )
    gpu.add_argument(
        "--blocks-per-chunk",
        type=values.integer(1),
        metavar="N",
        default=16,
        help="GPU blocks per cached chunk (16)",
    )
    gpu.add_argument(
        "--chunks-per-job",
        type=values.integer(1),
        metavar="N",
        default=4,
        help="chunks per store/load request (4)",
    )
    gpu.add_argument(
        "--latency-jobs",
        type=values.integer(0),
        metavar="N",
        default=200,
        help="single-chunk jobs timed one by one (200; 0 for none)",
    )
    gpu.add_argument(
        "--contiguous", action="store_true", help="consecutive block ids (default: shuffled)"
    )
    gpu.add_argument(
        "--allow-degraded",
        action="store_true",
        help="report, but do not fail, when copies are not batched or the arena not pinned",
    )
    gpu.add_argument(
        "--timeout",
        type=values.seconds,
        metavar="SECONDS",
        default=240.0,
        help="seconds for everything (default 240)",
    )
    gpu.add_argument(
        "--json", type=values.output_file, metavar="FILE", help="write the results as JSON"
    )
    gpu.set_defaults(handler=_check_gpu)

    completion = commands.add_parser(
        "completion",
        help="print a bash or zsh completion script (docs/operations.md says where it goes)",
        description="Print a completion script for the shell, made from this command line's "
        "own parser: subcommands, their flags and the flags' choices.",
    )
    completion.add_argument("shell", choices=["bash", "zsh"], help="the shell to complete for")
    completion.set_defaults(handler=_completion)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``offloadd`` console script.

    A command whose stdout's reader went away (``offloadd check-config | head -1``) ends
    quietly with ``BROKEN_PIPE``, whichever command it is (``--help`` and ``--version`` with
    0: argparse drops what it cannot write).
    """
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # what is still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # a socket's EPIPE: an error of the command, not of its reader
        _quiet_stdout()
        return BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse reports an unknown flag from the top-level parser, whose help does not
        # list the command's flags: point at the command's own, with the nearest flag.
        command = parser.commands[args.command]
        flags = [flag for action in command._actions for flag in action.option_strings]
        close = difflib.get_close_matches(unknown[0].partition("=")[0], flags, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    handler = args.handler
    status = handler(args)
    assert isinstance(status, int)
    return status


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader went away (the kernel reports an
    error or a hang-up on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        events = poller.poll(0)
    except (OSError, ValueError):
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _fd, mask in events)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: what is left in its buffer goes nowhere at exit, instead of
    the interpreter printing a BrokenPipeError it cannot flush."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
