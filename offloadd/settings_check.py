"""What a setting's value may be: the checks ``offloadd.settings`` runs on each value.

``coerce`` takes one value from where it comes from (a TOML file, an environment string, a
flag) to its field's type, then asks ``_CHECKS`` what the type cannot say (ranges, fractions,
endpoints, paths, octal modes, groups, key files, uid ranges, ...); a value it refuses is a
``SettingsError`` naming the setting and its source. Sizes (``parse_size``) and endpoints
(``endpoint_problem``, ``parse_address``) are checked here too, and the command line's flag
types use them. Nothing here knows the settings structs: ``offloadd.settings`` imports this
module, never the reverse.
"""

from __future__ import annotations

import grp
import itertools
import math
import os
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal, get_args, get_origin

import msgspec

from offloadd.safety import secret_file_problem
from protocol.peer import PEER_SUFFIX

AUTO = "auto"  # an events or metrics socket beside the control socket (Settings.exposed)
# What "auto" appends to the control socket's path.
EVENTS_SUFFIX, REPLAY_SUFFIX, METRICS_SUFFIX = ".events", ".replay", ".metrics"
_BESIDE_SUFFIXES = (PEER_SUFFIX, EVENTS_SUFFIX, REPLAY_SUFFIX, METRICS_SUFFIX)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
# What each unit multiplies by, case aside: SI units are decimal, IEC units binary (also
# in Kubernetes' short form, 8Gi). A bare K, M, G or T says neither: refused (AmbiguousSize).
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{prefix}b": 1000 ** (power + 1) for power, prefix in enumerate("kmgt")},
    **{f"{prefix}ib": 1 << 10 * (power + 1) for power, prefix in enumerate("kmgt")},
    **{f"{prefix}i": 1 << 10 * (power + 1) for power, prefix in enumerate("kmgt")},
}


class AmbiguousSize(ValueError):
    """A size whose unit is a bare K, M, G or T: 8G is 8 GiB to some tools and 8 GB to others."""


def parse_size(text: str) -> int:
    """``"8GiB"`` -> bytes: kB, MB, GB, TB are powers of 1000 (8GB = 8e9 bytes), KiB, MiB,
    GiB, TiB (and Ki, Mi, Gi, Ti) powers of 1024, in any case; a bare number, or B, is bytes;
    fractions of a byte are dropped. Raises ValueError, and AmbiguousSize (which says both
    readings) for a bare K, M, G or T."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match and unit in ("k", "m", "g", "t"):
        number, letter = match.group(1), match.group(2).upper()
        binary, decimal = parse_size(f"{number}{letter}iB"), parse_size(f"{number}{letter}B")
        raise AmbiguousSize(
            f"{text.strip()!r} is ambiguous: write {number}{letter}iB ({binary} bytes) or "
            f"{number}{letter}B ({decimal} bytes)"
        )
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 8GiB)")
    return int(Fraction(match.group(1)) * _SIZE_UNITS[unit])  # never negative: floored


def format_size(nbytes: int) -> str:
    """Bytes -> the largest binary unit that keeps it readable (``1.5GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"


ENDPOINT_EXAMPLES = "ipc:///run/offloadd/offloadd.sock or tcp://127.0.0.1:5557"
_SCHEMES = ("tcp", "ipc", "inproc")
_TCP_HOST = re.compile(r"[A-Za-z0-9._*-]+|\[[0-9A-Fa-f:.*]+\]")
_SUN_PATH_MAX = 107  # bytes in an ipc path (sockaddr_un.sun_path, less the NUL)


def endpoint_problem(text: str, *, bind: bool = False) -> str:
    """Why ``text`` is not a ZeroMQ endpoint offloadd can use, or ``""`` when it is.

    ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``. With ``bind`` the port may be
    ``*`` (the system picks one); a process that connects needs a number.
    """
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in _SCHEMES or not rest or rest != rest.strip():
        return f"expected an endpoint such as {ENDPOINT_EXAMPLES}, got {text!r}"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        low = 0 if bind else 1  # binding to port 0 or * lets the system pick one
        port_ok = (port.isdigit() and low <= int(port) <= 65535) or (bind and port == "*")
        if not colon or not _TCP_HOST.fullmatch(host) or not port_ok:
            return f"expected tcp://HOST:PORT (a port up to 65535), got {text!r}"
    if scheme == "ipc" and len(rest.encode()) > _SUN_PATH_MAX:
        return f"the path of {text!r} is longer than {_SUN_PATH_MAX} bytes (a socket limit)"
    return ""


def parse_address(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"`` / ``"[::1]:9464"`` / ``"host:0"`` -> (host, port)."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port_text)


# Settings in bytes that also take "8GiB"-style sizes.
SIZE_SETTINGS = frozenset(
    {
        ("cache", "capacity"),
        ("server", "max_frame_bytes"),
        ("limits", "event_buffer_bytes"),
        ("limits", "hello_bytes"),
        ("disk", "capacity"),
        ("disk", "queue_bytes"),
        ("mooncake", "segment"),
        ("mooncake", "local_buffer"),
        ("mooncake", "queue_bytes"),
    }
)
# Sizes whose 0 means "work it out at start" (disk.capacity: half the free space).
_SIZES_ZERO_MEANS_AUTO = frozenset({("disk", "capacity")})
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


class SettingsError(Exception):
    """A setting is unknown or has a value its field cannot take; the message names both."""


def coerce(
    section: str, key: str, value: Any, kind: Any, head: str, tail: str, from_env: bool
) -> Any:
    """``value`` as the field's type, or a SettingsError ``head + problem + tail``."""
    if (section, key) in SIZE_SETTINGS:
        least = 0 if (section, key) in _SIZES_ZERO_MEANS_AUTO else 1
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return _size_in_bounds(section, key, value, value, head, tail)
        if isinstance(value, str):
            try:
                size = parse_size(value)
            except AmbiguousSize as exc:
                raise SettingsError(f"{head}{exc}{tail}") from None
            except ValueError:
                size = -1
            if size >= least:
                return _size_in_bounds(section, key, size, value, head, tail)
        raise SettingsError(f"{head}expected a size like 8GiB, got {value!r}{tail}")
    if from_env:
        value = _from_string(value, kind)
    if get_origin(kind) is Literal and isinstance(value, str):
        value = value.strip().lower()  # every choice is lower case: "LRU" means "lru"
    try:
        converted = msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError:
        raise SettingsError(f"{head}expected {_describe(kind)}, got {value!r}{tail}") from None
    check = _CHECKS.get((section, key))
    problem = check(converted) if check else ""
    if problem:
        raise SettingsError(f"{head}{problem}{tail}")
    return converted


MIN_CAPACITY = 64 << 10  # below this no engine's chunk fits (a chunk is pages of all layers)


def _size_in_bounds(section: str, key: str, size: int, given: Any, head: str, tail: str) -> int:
    """``size``, unless it is an arena capacity that could hold no chunk. (More than this
    machine's memory is a question about the machine: ``offloadd.server.preflight``.)"""
    if (section, key) == ("cache", "capacity") and size < MIN_CAPACITY:
        raise SettingsError(
            f"{head}{given!r} is {size} bytes, too small to hold a chunk: give at least "
            f"64KiB, with a unit (8GiB){tail}"
        )
    return size


def log_level_problem(level: str) -> str:
    """Why ``level`` is not a logging level name, or ``""``."""
    if level.upper() in _LOG_LEVELS:
        return ""
    return f"expected one of {', '.join(_LOG_LEVELS)}, got {level!r}"


UNIX_PREFIX = "unix:"


def _address_problem(address: str) -> str:
    if address == AUTO:
        return ""
    if address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX) :]
        if not os.path.isabs(path) or len(path.encode()) > 107:
            return f"expected unix:/ABSOLUTE/PATH (at most 107 bytes), got {address!r}"
        return ""
    try:
        if address:
            parse_address(address)
    except ValueError:
        return (
            f'expected HOST:PORT, unix:/PATH, "auto" (beside the control socket) or "" to '
            f"turn metrics off, got {address!r}"
        )
    return ""


def _endpoint_check(empty: str, *, auto: bool = True) -> Callable[[str], str]:
    """An endpoint setting's check; ``empty`` says what ``""`` means there, ``auto`` whether
    it takes ``"auto"`` (beside the control socket)."""
    also = '"auto" for beside the control socket, or ' if auto else "or "

    def check(text: str) -> str:
        if not text or (auto and text == AUTO):
            return ""
        problem = endpoint_problem(text, bind=True)
        return f'{problem}; {also}"" for {empty}' if problem else ""

    return check


def _control_endpoint_problem(text: str) -> str:
    default = "the default ipc socket in the runtime directory"
    problem = _endpoint_check(default, auto=False)(text)
    if problem or not text.startswith("ipc://"):
        return problem
    longest = max(_BESIDE_SUFFIXES, key=len)
    if len(text[len("ipc://") :].encode()) + len(longest) > _SUN_PATH_MAX:
        return (
            f"the path of {text!r} leaves no room for the sockets beside it (registration, "
            f"events, metrics: PATH{longest}, at most {_SUN_PATH_MAX} bytes): use a shorter path"
        )
    return ""


def _groups_problem(groups: tuple[str, ...]) -> str:
    for group in groups:
        problem = _socket_group_problem(group) if group else "expected group names"
        if problem:
            return problem.split(";")[0]
    return ""


def _fraction_problem(value: float) -> str:
    if math.isfinite(value) and 0 < value <= 1:
        return ""
    return f"expected a fraction above 0 and at most 1, got {value!r}"


def _fraction_or_zero_problem(value: float) -> str:
    return "" if value == 0 else _fraction_problem(value)


def _absolute_path_problem(path: str) -> str:
    if path and not os.path.isabs(path):
        return f"expected an absolute path, got {path!r}"
    return ""


def _arena_problem(path: str) -> str:
    problem = _absolute_path_problem(path)
    if problem or not path:
        return f'{problem}; or "" for /dev/shm/offloadd-<uid>/arena' if problem else ""
    if not os.path.isdir(os.path.dirname(path)):
        return f"directory {os.path.dirname(path)!r} of {path!r} does not exist"
    return ""


def _disk_path_problem(path: str) -> str:
    problem = _absolute_path_problem(path)
    return f'{problem}; or "" for no disk tier' if problem else ""


_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_DEVICE_NAMES = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*")


def _master_problem(address: str) -> str:
    if not address:
        return ""
    try:
        _, port = parse_address(address)
    except ValueError:
        port = 0
    if port == 0 or not _HOST_NAME.fullmatch(address.rpartition(":")[0]):
        return f'expected HOST:PORT of mooncake_master, or "" for no cluster tier, got {address!r}'
    return ""


def _metadata_problem(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if url and (scheme not in ("http", "etcd") or not sep or not rest or " " in rest):
        return (
            "expected http://HOST:PORT/metadata (or etcd://HOST:PORT), "
            f'or "" for the master\'s host on port 8080, got {url!r}'
        )
    return ""


def _host_name_problem(name: str) -> str:
    if name and not _HOST_NAME.fullmatch(name):
        return f'expected a host name or address, or "" for this host\'s name, got {name!r}'
    return ""


def _rdma_devices_problem(names: str) -> str:
    if names and not _DEVICE_NAMES.fullmatch(names):
        return f'expected device names such as mlx5_0,mlx5_1, or "" for all, got {names!r}'
    return ""


def _journal_problem(path: str) -> str:
    problem = _absolute_path_problem(path)
    return f'{problem}; or "" for <state dir>/<arena name>.journal' if problem else ""


def _shm_dirs_problem(dirs: tuple[str, ...]) -> str:
    if not dirs:
        return "expected at least one directory"
    bad = [d for d in dirs if not d or not os.path.isabs(d)]
    return f"expected absolute paths, got {bad[0]!r}" if bad else ""


def _socket_mode_problem(mode: str) -> str:
    if re.fullmatch(r"0?[0-7]{3}", mode):
        return ""
    return f'expected octal permission bits such as "0660", got {mode!r}'


def _socket_group_problem(group: str, empty: str = "to leave the socket's group") -> str:
    if not group:
        return ""
    try:
        grp.getgrnam(group)
    except KeyError:
        return f'no group {group!r} on this host; or "" {empty}'
    return ""


def _events_socket_mode_problem(mode: str) -> str:
    problem = _socket_mode_problem(mode) if mode else ""
    return problem.replace(", got", ', or "" for the control socket\'s, got')


def _events_socket_group_problem(group: str) -> str:
    return _socket_group_problem(group, "for the control socket's (server.socket_group)")


def _existing(kind: str, test: Callable[[str], bool]) -> Callable[[str], str]:
    def check(path: str) -> str:
        if path and not test(path):
            return f'no {kind} {path!r}; or "" for none'
        return ""

    return check


def _curve_key_problem(path: str) -> str:
    if not path:
        return ""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        return f'cannot read {path!r} ({exc.strerror or exc}); or "" for no CURVE'
    except ValueError:
        public, secret = b"", None
    if len(public) != 40 or secret is None or len(secret) != 40:
        return f"{path!r} holds no CURVE key pair (public-key and secret-key, zmq.auth format)"
    return ""


def _topic_template_problem(template: str) -> str:
    try:
        template.format(pod="", tenant="", model="", engine_id="", dp=0)
    except (KeyError, IndexError, ValueError, AttributeError):
        names = "{pod} {tenant} {model} {engine_id} {dp}"
        return f"bad topic template {template!r}; placeholders are {names}"
    return ""


def _at_least(low: float, *, above: bool = False) -> Callable[[float], str]:
    """A number's check: finite and ``>= low`` (``> low`` with ``above``)."""

    def check(value: float) -> str:
        if math.isfinite(value) and (value > low if above else value >= low):
            return ""
        bound = f"above {low:g}" if above else f"at least {low:g}"
        return f"expected a number {bound}, got {value!r}"

    return check


def _cluster_key_problem(path: str) -> str:
    """A cluster key must be a 0600 file of the daemon's user (checked again when read)."""
    return secret_file_problem(path) if path else ""


_CLUSTER_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_LOCAL_IDENTITY = re.compile(r"(uid|gid):(\d{1,10})\Z|range:[A-Za-z0-9_.-]{1,64}\Z")
# The tenant names offloadd.server.tenancy makes by itself: a uid range may not take one.
_DERIVED_TENANT = re.compile(r"[ug]\d+\Z|remote\Z")
_UID_RANGE = re.compile(r"(\d{1,10})-(\d{1,10})\Z")
MAX_UID = 2**32 - 2  # (uid_t)-1 is "no uid"


def _uid_ranges_problem(tenants: dict[str, list[str]]) -> str:
    """Tenant names from a short alphabet and unlike the derived ones (``u1000``); ranges
    ``FIRST-LAST`` within 1..2**32-2 (never root), no uid in two of them."""
    spans: list[tuple[int, int, str]] = []
    for name, ranges in tenants.items():
        if not _CLUSTER_TENANT.match(name):
            return f"tenant name {name!r}: expected 1-64 of A-Z a-z 0-9 _ . -"
        if _DERIVED_TENANT.match(name):
            return f"tenant name {name!r} is one offloadd gives by itself (u<uid>, g<gid>, remote)"
        if not ranges:
            return f"tenant {name}: no range"
        for text in ranges:
            match = _UID_RANGE.match(text)
            first, last = (int(match[1]), int(match[2])) if match else (0, -1)
            if not match or not 1 <= first <= last <= MAX_UID:
                return (
                    f"tenant {name}: {text!r} is not FIRST-LAST with 1 <= FIRST <= LAST <= "
                    f"{MAX_UID} (uid 0 is root, never a tenant's)"
                )
            spans.append((first, last, name))
    spans.sort()
    for (_, last, name), (first, _, other) in itertools.pairwise(spans):
        if first <= last:
            return f"uid {first} is in the ranges of both {name} and {other}"
    return ""


def _cluster_tenants_problem(tenants: dict[str, list[str]]) -> str:
    """Names from a short alphabet; each local identity ("uid:N", "gid:N", "range:NAME") in
    one tenant."""
    seen: dict[str, str] = {}
    for name, members in tenants.items():
        if not _CLUSTER_TENANT.match(name):
            return f"tenant name {name!r}: expected 1-64 of A-Z a-z 0-9 _ . -"
        for member in members:
            if not _LOCAL_IDENTITY.match(member):
                return f"tenant {name}: {member!r} is not uid:N, gid:N or range:NAME"
            if member in seen:
                return f"{member} is in both tenants {seen[member]} and {name}"
            seen[member] = name
    return ""


# What a field's type cannot say: a message, or "" when the value is fine.
_CHECKS: dict[tuple[str, str], Callable[[Any], str]] = {
    ("server", "endpoint"): _control_endpoint_problem,
    ("server", "shm_dirs"): _shm_dirs_problem,
    ("server", "drain_seconds"): _at_least(0),
    ("server", "recent_jobs"): _at_least(1),
    ("server", "session_timeout"): _at_least(0, above=True),
    ("server", "mirror_ack_timeout"): _at_least(0, above=True),
    ("server", "socket_mode"): _socket_mode_problem,
    ("server", "socket_group"): _socket_group_problem,
    ("server", "curve_secret_key_file"): _curve_key_problem,
    ("server", "curve_clients_dir"): _existing("directory", os.path.isdir),
    ("cache", "arena"): _arena_problem,
    ("cache", "journal"): _journal_problem,
    ("cache", "pin_lease_seconds"): _at_least(0, above=True),
    ("log", "level"): log_level_problem,
    ("events", "endpoint"): _endpoint_check("no events"),
    ("events", "replay_endpoint"): _endpoint_check("no replay"),
    ("events", "buffer_steps"): _at_least(0),
    ("events", "hwm"): _at_least(0),
    ("events", "max_queue"): _at_least(1),
    ("events", "topic_template"): _topic_template_problem,
    ("events", "socket_mode"): _events_socket_mode_problem,
    ("events", "socket_group"): _events_socket_group_problem,
    ("metrics", "address"): _address_problem,
    ("metrics", "socket_mode"): _socket_mode_problem,
    ("metrics", "socket_group"): _socket_group_problem,
    ("tenancy", "shared_groups"): _groups_problem,
    ("tenancy", "uid_ranges"): _uid_ranges_problem,
    ("limits", "regions_per_session"): _at_least(1),
    ("limits", "key_bytes"): _at_least(5),
    ("limits", "keys_per_request"): _at_least(1),
    ("limits", "protected_fraction"): _fraction_problem,
    ("limits", "tenant_protected_fraction"): _fraction_or_zero_problem,
    ("limits", "reservation_seconds"): _at_least(0, above=True),
    ("limits", "reservation_renewals"): _at_least(0),
    ("limits", "mapped_bytes_per_uid"): _at_least(0),
    ("limits", "max_lease_seconds"): _at_least(0, above=True),
    ("limits", "jobs_per_session"): _at_least(1),
    ("limits", "sessions_per_uid"): _at_least(1),
    ("limits", "snapshot_keys"): _at_least(0),
    ("limits", "registrations_per_uid"): _at_least(1),
    ("limits", "token_seconds"): _at_least(0, above=True),
    ("limits", "connections_per_uid"): _at_least(1),
    ("limits", "descriptors_per_uid"): _at_least(1),
    ("limits", "hello_bytes"): _at_least(1024),
    ("limits", "lookups_per_message"): _at_least(1),
    ("limits", "jobs_per_message"): _at_least(1),
    ("limits", "keys_per_message"): _at_least(1),
    ("limits", "fragments_per_page"): _at_least(1),
    ("limits", "fragments_per_hello"): _at_least(1),
    ("limits", "socket_connections"): _at_least(1),
    ("limits", "socket_connections_per_uid"): _at_least(1),
    ("limits", "metrics_connections"): _at_least(1),
    ("limits", "waiting_stores_per_tenant"): _at_least(1),
    ("disk", "path"): _disk_path_problem,
    ("mooncake", "master"): _master_problem,
    ("mooncake", "metadata"): _metadata_problem,
    ("mooncake", "rdma_devices"): _rdma_devices_problem,
    ("mooncake", "local_hostname"): _host_name_problem,
    ("mooncake", "lookup_timeout"): _at_least(0, above=True),
    ("mooncake", "key_file"): _cluster_key_problem,
    ("mooncake", "tenants"): _cluster_tenants_problem,
}


def _from_string(text: str, kind: Any) -> Any:
    """An environment string as the Python value the field wants (left as is if it can't)."""
    stripped = text.strip()
    if kind is bool:
        lowered = stripped.lower()
        return True if lowered in _TRUE else False if lowered in _FALSE else text
    if kind is int:
        try:
            return int(stripped)
        except ValueError:
            return text
    if kind is float:
        try:
            return float(stripped)
        except ValueError:
            return text
    if get_origin(kind) is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text


def _describe(kind: Any) -> str:
    if kind is bool:
        return "true or false"
    if kind is int:
        return "an integer"
    if kind is float:
        return "a number"
    if kind is str:
        return "a string"
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in get_args(kind))
    if get_origin(kind) is tuple:
        return "a list of strings"
    return str(kind)
