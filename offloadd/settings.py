"""Daemon settings: typed structs with defaults that work with no file at all.

An empty string has one documented meaning per setting, the same from every source:

* "derive a default": ``server.endpoint`` (the control socket goes in the runtime directory:
  ``$RUNTIME_DIRECTORY`` under systemd, else ``/run/offloadd`` where it exists, else
  ``$XDG_RUNTIME_DIR/offloadd``, else ``/tmp/offloadd-<uid>``), ``cache.arena``
  (``/dev/shm/offloadd-<uid>/arena``, in a directory of the daemon's own), ``cache.journal``
  (the arena's commit journal, and its key, in the state directory: ``$STATE_DIRECTORY``
  under systemd, else ``$XDG_STATE_HOME/offloadd``, else ``~/.local/state/offloadd``, where
  no rank can reach it), ``events.pod`` (the host name), ``events.socket_mode`` and
  ``events.socket_group`` (the control socket's: ``server.socket_mode``,
  ``server.socket_group``);
* "off": ``events.endpoint`` (no KV events, as ``enabled = false``),
  ``events.replay_endpoint`` (no replay socket), ``metrics.address`` (no HTTP server),
  ``metrics.socket_group`` (the metrics socket's group is left as created),
  ``server.socket_group`` (the group is left as created), ``server.curve_secret_key_file``
  (no CURVE), ``server.curve_clients_dir`` (with CURVE on loopback: any client key; off
  loopback an allow-list is required);
* itself: ``events.topic_template`` (the topic ``""``, which every subscriber receives);

``"auto"`` (the default of ``events.endpoint``, ``events.replay_endpoint`` and
``metrics.address``) puts the socket beside the control socket, in its checked directory:
``ipc://PATH.events``, ``ipc://PATH.replay`` (beside a ``tcp://`` events endpoint: its next
port) and ``unix:PATH.metrics`` for the control socket ``ipc://PATH`` (``Settings.exposed``);
tcp is only ever an explicit setting.
* no entries: ``tenancy.shared_groups`` (``""`` from the environment, ``[]`` in a file).

Every other setting rejects ``""``.

``load_settings`` layers the sources, later ones winning: built-in defaults < a TOML file
(``[section]`` tables) < environment variables ``OFFLOADD_<SECTION>__<KEY>`` < command-line
flags. Every value is checked against its field where it comes from (type, then range or
shape: endpoints, paths, octal modes, ...), so an unknown section or key, or a value the
setting cannot take, is a ``SettingsError`` whose one-line message names the setting and its
source. Environment values are strings, converted to the field's type: integers, numbers,
booleans (true/false/1/0/yes/no/on/off), strings, comma-separated lists; sizes such as
``8GiB`` are accepted for every setting in bytes (``cache.capacity``, ``disk.capacity``,
``mooncake.segment``, ...) everywhere: ``8GB`` is 8e9 bytes and ``8GiB`` 8 * 2**30, as the
units say, and a bare ``8G``, which tools read either way, is refused with both readings
(``parse_size``).
"""

from __future__ import annotations

import difflib
import grp
import itertools
import logging
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import IO, Any, Literal, get_args, get_origin

import msgspec

from offloadd.endpoint import default_endpoint, ipc_path, replay_beside, state_dir
from offloadd.logs import install_log_handler
from offloadd.safety import secret_file_problem
from protocol.peer import PEER_SUFFIX

AUTO = "auto"  # an events or metrics socket beside the control socket (Settings.exposed)
# What "auto" appends to the control socket's path.
EVENTS_SUFFIX, REPLAY_SUFFIX, METRICS_SUFFIX = ".events", ".replay", ".metrics"
_BESIDE_SUFFIXES = (PEER_SUFFIX, EVENTS_SUFFIX, REPLAY_SUFFIX, METRICS_SUFFIX)


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The control socket and request limits."""

    endpoint: str = ""
    max_frame_bytes: int = 16 << 20
    shm_dirs: tuple[str, ...] = ("/dev/shm",)
    drain_seconds: float = 10.0
    recent_jobs: int = 4096  # finished jobs remembered per session for Wait
    # A session whose process the daemon cannot watch (pidfd) is reaped after this long
    # without any message; clients send heartbeats well within it.
    session_timeout: float = 30.0
    # A scheduler whose key mirror leaves a removal unacknowledged this long (the daemon's
    # running time) is dropped: removed keys keep their bytes until every mirror acknowledged,
    # so a silent mirror would block evictions for every engine sharing its namespace.
    mirror_ack_timeout: float = 5.0
    # "cuda": ranks register CUDA IPC handles, copies run on daemon-owned CUDA streams and
    # the arena is registered as pinned memory (needs a GPU and a CUDA 12.8+ driver).
    # "cpu": ranks register shared-memory files. "auto": cuda where a device and a driver
    # with the batched copy are there, else cpu (chosen and logged at start).
    copy_engine: Literal["auto", "cpu", "cuda"] = "auto"
    # The ipc socket's permission bits (octal) and group: ranks of that group may connect.
    # Event ipc sockets get the same unless events.socket_mode/group say otherwise (a unix:
    # metrics socket has metrics.socket_mode/group).
    socket_mode: str = "0660"
    socket_group: str = ""
    # A tcp:// control endpoint off loopback must be encrypted and authenticated with
    # CURVE: the daemon's secret key file (zmq.auth format, `*.key_secret`, mode 0600) and a
    # directory of the client public keys allowed in (`*.key`).
    curve_secret_key_file: str = ""
    curve_clients_dir: str = ""


class CacheSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The host chunk cache."""

    arena: str = ""
    capacity: int = 1 << 30
    policy: Literal["lru", "arc"] = "lru"
    pin_lease_seconds: float = 30.0
    # Keep the arena and a commit journal across restarts, so a restarted daemon serves what
    # was committed before. False: the arena is removed at exit and no journal is kept.
    persist: bool = True
    # The commit journal; its MAC key is "<journal>.key". "" = <state dir>/<arena name>.journal.
    # Never inside server.shm_dirs (ranks name files there).
    journal: str = ""


class LogSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Logging to stderr.

    ``format``: "journal" writes ``<priority>logger: message`` lines without timestamps,
    which journald files under the right priority; "plain" writes timestamped lines; "auto"
    picks "journal" when stderr goes to the journal (``$JOURNAL_STREAM`` is set, as under
    systemd) and "plain" otherwise; "json" writes one JSON object per line (``time`` in
    RFC 3339 UTC, ``level``, ``logger``, ``message``, ``exc_info``) for log pipelines such as
    Kubernetes'.
    """

    level: str = "INFO"
    format: Literal["auto", "plain", "journal", "json"] = "auto"


class EventSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """KV-cache events: vLLM-compatible PUB socket and replay ROUTER.

    ``"auto"``: ipc sockets beside the control socket. Every ipc events and replay socket gets
    ``socket_mode`` and ``socket_group`` (who may subscribe: every tenant's block hashes go
    out there); ``""``, the default, is the control socket's (``server.socket_mode``,
    ``server.socket_group``), so the ranks' group reads them; a monitoring group of its own
    takes ``socket_group = "GROUP"`` with ``socket_mode = "0660"`` (connecting needs write
    permission). tcp is an explicit setting; one off loopback is logged as a warning at start
    (anyone who reaches the port reads them).
    The tenant (``{tenant}``: ``u<uid>``, ``g<gid>``, ``*``) is part of the default topic, so
    no tenant publishes events a router would attribute to another.
    """

    enabled: bool = True
    endpoint: str = AUTO  # "" turns events off (as enabled = false does)
    replay_endpoint: str = AUTO  # "" disables replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark, in batches
    max_queue: int = 100_000  # batches waiting to be sent; more are dropped and counted
    # Placeholders: {pod} {tenant} {model} {engine_id} {dp}. Three @-separated parts, as
    # vLLM's kv@{pod}@{model}, for routers that split topics that way.
    topic_template: str = "kv@{pod}/{tenant}@{model}"
    pod: str = ""  # empty: the host name
    # vLLM's convention: the engine with dp index k publishes on endpoint port + k (and
    # replay port + k); otherwise one publisher serves every dp index.
    port_per_dp: bool = False
    socket_mode: str = ""  # "": server.socket_mode
    socket_group: str = ""  # "": server.socket_group

    def pod_name(self) -> str:
        """The ``{pod}`` of topics, defaulted to the host name."""
        return self.pod or socket.gethostname()


class MetricsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prometheus metrics over HTTP (``/metrics``, ``/healthz``, ``/readyz``).

    ``"auto"``: a unix socket beside the control socket (``unix:PATH.metrics``); ``unix:/PATH``
    another one; ``HOST:PORT`` tcp, an explicit setting (Prometheus scrapes tcp only): a
    loopback port is open to every local user, another address to whoever reaches it (logged
    as a warning at start). ``""`` turns it off. The unix socket gets ``socket_mode`` and
    ``socket_group``: by default only the daemon's user and root may read it, since metrics
    name every tenant's engines and count their bytes (GetStats shows them to admins only).
    """

    address: str = AUTO  # auto, HOST:PORT, [IPv6]:PORT, unix:/PATH; port 0: a free one
    socket_mode: str = "0600"
    socket_group: str = ""


class TenancySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who shares with whom, by the identity the kernel gives each local peer (SO_PEERCRED).

    By default every uid is a tenant of its own: its engines, sessions, namespaces (cached
    chunks) and what GetStats shows are its own. ``share_across_uids`` makes every local
    user one tenant (one trust domain); ``shared_groups`` makes the users whose *primary*
    group is one of these one tenant per group. Sessions are only ever replaced by the same
    uid. ``client_topics``: ranks may name their engine's KV-event topic (else the daemon's
    ``events.topic_template`` decides, and a Hello naming another topic is refused).
    ``uid_ranges`` names tenants by ranges of uids, before every other rule: a uid in a range
    is that tenant, whatever its group (on Kubernetes, one range per namespace, which an
    admission policy holds that namespace's pods to; docs/kubernetes.md). With
    ``uid_ranges_only`` a Hello from a uid in no range (root and the daemon's user included)
    is refused: only tenants' engines have sessions.
    """

    share_across_uids: bool = False
    shared_groups: tuple[str, ...] = ()
    client_topics: bool = False
    # Tenants by uid range: name -> ranges "FIRST-LAST" (inclusive), e.g.
    # { team-a = ["41000-41999"] }; the tenant is the name (in topics, `cache ls`, stats).
    uid_ranges: dict[str, list[str]] = msgspec.field(default_factory=dict)
    # With uid_ranges: refuse a Hello from a uid in none of them (engines are tenants' only).
    uid_ranges_only: bool = False

    def uid_range_table(self) -> list[tuple[int, int, str]]:
        """``uid_ranges`` as (first, last, tenant) triples, in order of ``first``."""
        table = []
        for name, ranges in self.uid_ranges.items():
            for text in ranges:
                first, _, last = text.partition("-")
                table.append((int(first), int(last), name))
        return sorted(table)


class LimitsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds per session, per engine and per user, so that no client can exhaust the daemon.

    ``protected_fraction``: bytes an engine's sessions may keep from eviction (lookup pins,
    scheduler holds and reservations) as a fraction of ``cache.capacity``; beyond it pins and
    holds are not taken and reservations are refused. ``tenant_protected_fraction``: the same
    bound for all the engines of one tenant (a uid, or a shared group) together, so a user
    who starts more engines gets no more of the arena (0: ``protected_fraction``).
    ``reservation_seconds``: how long a scheduler's reservation waits for its ranks' store;
    one not committed by then is dropped and its room freed (counted as ``expired``).
    ``reservation_renewals``: how many times more a key may be reserved before it is stored
    (reserved again once its reservation lapsed or its scheduler left): a renewing lease
    ends after ``(1 + reservation_renewals) * reservation_seconds``; beyond, the key is not
    reserved (counted as ``expired``) until it is stored.
    ``mapped_bytes_per_uid``: bytes of shared-memory region files a uid's live sessions may
    make the daemon map or reserve address space for (0: the host's memory, ``MemTotal``).
    ``max_lease_seconds`` caps a Lookup's pin lease. ``snapshot_keys``: chunks announced (KV
    events) to an engine that becomes ready in a warm namespace, at most.
    ``event_buffer_bytes``: the replay buffer of each event publisher, at most (besides
    ``events.buffer_steps``). ``registrations_per_uid``:
    registration tokens (and the descriptors they hold) a uid may have waiting for their
    Hello; unused ones expire after ``token_seconds``. ``connections_per_uid``: registration
    connections a uid may hold open at once. ``descriptors_per_uid``: descriptors a uid's
    registrations (waiting or arriving) and live sessions may make the daemon hold, well
    below the unit's ``LimitNOFILE``. ``hello_bytes``: the largest encoded Hello, checked on
    the raw frame before it is decoded. ``lookups_per_message``: Lookups one scheduler step
    message (Reserve, UpdateHolds) may carry; ``jobs_per_message``: jobs in one StepJobs;
    ``keys_per_message``: keys in one message, every list of it and of its nested Lookups or
    jobs together; ``fragments_per_page``: copy fragments (the runs' ``num_fragments``,
    summed) in one region's canonical page, and ``fragments_per_hello`` in all the regions of
    one Hello. Each is refused (``TOO_LARGE``) before any of its work is done.
    ``socket_connections``: connections each ZeroMQ socket (control, events, replay) keeps
    open, and ``socket_connections_per_uid`` of one uid (all tcp peers count as one); a
    newcomer beyond is closed as soon as it is accepted. ``metrics_connections``: metrics
    connections served at once. Together they stay below the descriptor limit.
    ``waiting_stores_per_tenant``: rank stores of one tenant that may wait for their
    scheduler's Reserve (or for room another mirror frees), of the 4,096 all tenants may; a
    store beyond is not stored, and its ``JobDone`` says so.
    """

    regions_per_session: int = 1024
    key_bytes: int = 128
    keys_per_request: int = 1 << 16
    protected_fraction: float = 0.5
    tenant_protected_fraction: float = 0.0
    reservation_seconds: float = 5.0
    # Times more a key may be reserved before it is stored (its lease renewed): beyond, not
    # reserved until stored.
    reservation_renewals: int = 3
    mapped_bytes_per_uid: int = 0
    max_lease_seconds: float = 300.0
    jobs_per_session: int = 1024
    sessions_per_uid: int = 256
    snapshot_keys: int = 1 << 16
    event_buffer_bytes: int = 256 << 20
    registrations_per_uid: int = 64
    token_seconds: float = 30.0
    connections_per_uid: int = 8
    descriptors_per_uid: int = 8192
    hello_bytes: int = 1 << 20
    lookups_per_message: int = 4096
    jobs_per_message: int = 4096
    keys_per_message: int = 1 << 20
    fragments_per_page: int = 1 << 16
    fragments_per_hello: int = 1 << 18
    socket_connections: int = 2048
    socket_connections_per_uid: int = 1024
    metrics_connections: int = 64
    # Rank stores of one tenant that may wait for their Reserve (of 4,096 for all tenants);
    # a store beyond is not stored, and its JobDone says so.
    waiting_stores_per_tenant: int = 1024


class DiskSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[disk]``: the local disk tier below the arena; off while ``path`` is empty.

    Every committed chunk is also written to a file under ``path`` (in the background), so a
    chunk evicted from host memory is found again there and promoted back on use. Files are
    checksummed (a torn or corrupted one is dropped, never served) and kept across restarts.
    """

    path: str = ""
    capacity: int = 0  # bytes the tier may fill; 0: half the file system's free space at start
    direct_io: bool = True  # O_DIRECT where the file system allows it
    queue_bytes: int = 256 << 20  # demotions waiting for the disk; beyond, chunks are skipped


class MooncakeSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[mooncake]``: the cluster tier on Mooncake Store; off while ``master`` is empty."""

    master: str = ""  # HOST:PORT of mooncake_master
    metadata: str = ""  # http://HOST:8080/metadata; empty: the master's host, port 8080
    segment: int = 1 << 30  # host memory this daemon contributes to the cluster pool
    local_buffer: int = 64 << 20  # the client's own transfer buffer
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""  # e.g. "mlx5_0,mlx5_1"; empty: all (rdma only)
    local_hostname: str = ""  # how peers reach this node; empty: the host name
    lookup_timeout: float = 0.05  # seconds a lookup waits for the cluster before a miss
    queue_bytes: int = 256 << 20  # publications waiting for the cluster; beyond, skipped
    # The cluster key: a 0600 file of 32 random bytes, the same on every daemon of the
    # cluster (companion MACs, payload encryption, object names); required.
    key_file: str = ""
    # Cluster tenants: name -> the local identities that are it ("uid:1000", "gid:2000", a
    # gid as tenancy.shared_groups makes one tenant of, "range:NAME" a tenancy.uid_ranges
    # tenant). Unmapped tenants skip the cluster.
    tenants: dict[str, list[str]] = msgspec.field(default_factory=dict)

    def cluster_tenants(self) -> dict[str, str]:
        """``tenants`` as local tenant (``u1000``, ``g2000``, a uid range's name) -> the
        cluster tenant it is."""
        local: dict[str, str] = {}
        for name, members in self.tenants.items():
            for member in members:
                kind, _, rest = member.partition(":")
                if kind == "range":
                    local[rest] = name
                else:
                    local[("u" if kind == "uid" else "g") + str(int(rest))] = name
        return local


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the daemon reads at start."""

    server: ServerSettings = ServerSettings()
    cache: CacheSettings = CacheSettings()
    log: LogSettings = LogSettings()
    events: EventSettings = EventSettings()
    metrics: MetricsSettings = MetricsSettings()
    tenancy: TenancySettings = TenancySettings()
    limits: LimitsSettings = LimitsSettings()
    disk: DiskSettings = DiskSettings()
    mooncake: MooncakeSettings = MooncakeSettings()

    def endpoint(self) -> str:
        """The control endpoint, defaulted."""
        return self.server.endpoint or default_endpoint()

    def arena_path(self) -> str:
        """The arena file, defaulted."""
        return self.cache.arena or os.path.join(default_arena_dir(), "arena")

    def journal_path(self) -> str:
        """The commit journal, defaulted beside nothing a rank can name."""
        if self.cache.journal:
            return self.cache.journal
        # The default keeps the name it had when the arena lay in /dev/shm itself.
        name = os.path.basename(self.cache.arena) or f"offloadd-{os.getuid()}.arena"
        return os.path.join(state_dir(), name + ".journal")

    def exposed(self) -> Settings:
        """These settings with each ``"auto"`` events and metrics endpoint made concrete:
        beside the control socket ``ipc://PATH`` (a tcp control endpoint: beside the default
        one), as ``ipc://PATH.events``, ``ipc://PATH.replay`` (the next port beside a tcp
        events endpoint) and ``unix:PATH.metrics``; and the events sockets' mode and group,
        ``""`` for the control socket's, made the control socket's. The daemon and its checks
        use these."""
        events, metrics = self.events, self.metrics
        events = msgspec.structs.replace(
            events,
            socket_mode=events.socket_mode or self.server.socket_mode,
            socket_group=events.socket_group or self.server.socket_group,
        )
        if AUTO not in (events.endpoint, events.replay_endpoint, metrics.address):
            return msgspec.structs.replace(self, events=events)
        beside = ipc_path(self.endpoint()) or ipc_path(default_endpoint()) or ""
        endpoint = f"ipc://{beside}{EVENTS_SUFFIX}" if events.endpoint == AUTO else events.endpoint
        replay = events.replay_endpoint
        if replay == AUTO:
            tcp = endpoint.startswith("tcp://")
            replay = replay_beside(endpoint) if tcp else f"ipc://{beside}{REPLAY_SUFFIX}"
        address = metrics.address
        if address == AUTO:
            address = f"{UNIX_PREFIX}{beside}{METRICS_SUFFIX}"
        return msgspec.structs.replace(
            self,
            events=msgspec.structs.replace(events, endpoint=endpoint, replay_endpoint=replay),
            metrics=msgspec.structs.replace(metrics, address=address),
        )


def default_arena_dir() -> str:
    """``/dev/shm/offloadd-<uid>``: the daemon's own 0700 directory for the default arena."""
    return f"/dev/shm/offloadd-{os.getuid()}"


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


# --------------------------------------------------------------------------- loading

ENV_PREFIX = "OFFLOADD_"
_SECTIONS: dict[str, type[msgspec.Struct]] = {
    info.name: info.type for info in msgspec.structs.fields(Settings)
}
SETTINGS_SECTIONS: Mapping[str, type[msgspec.Struct]] = _SECTIONS  # section name -> its struct
_FIELDS: dict[str, dict[str, Any]] = {
    name: {info.name: info.type for info in msgspec.structs.fields(section)}
    for name, section in _SECTIONS.items()
}
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


def load_settings(
    path: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    flags: Mapping[str, Mapping[str, tuple[Any, str]]] | None = None,
) -> Settings:
    """Defaults < TOML file at ``path`` < ``OFFLOADD_<SECTION>__<KEY>`` in ``environ``
    (default ``os.environ``) < ``overrides`` (already typed; sizes may be strings) <
    ``flags`` (the same as ``{section: {key: (value, flag)}}``: errors name the flag as the
    source). Raises ``SettingsError``."""
    data: dict[str, dict[str, Any]] = {}
    if path:
        _merge(data, _read_toml(path), path, from_env=False)
    env = os.environ if environ is None else environ
    _merge(data, _env_layer(env), "the environment", from_env=True)
    if overrides:
        _merge(data, overrides, "the command line", from_env=False)
    if flags:
        _merge(data, flags, "the command line", from_env=False, named=True)
    try:
        settings = msgspec.convert(data, Settings, strict=True)
    except msgspec.ValidationError as exc:  # every value was checked: a bug if this happens
        raise SettingsError(f"invalid settings: {exc}") from None
    return settings


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise SettingsError(f"cannot read settings file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path} is not valid TOML: {exc}") from None


def _env_layer(env: Mapping[str, str]) -> dict[str, dict[str, tuple[str, str]]]:
    """``{section: {key: (value, variable name)}}`` from OFFLOADD_<SECTION>__<KEY>."""
    layer: dict[str, dict[str, tuple[str, str]]] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        section, sep, key = rest.partition("__")
        if not sep:
            # Other OFFLOADD_* variables are not ours to judge, but OFFLOADD_CACHE_CAPACITY
            # is surely a setting with one underscore too few.
            for known in _SECTIONS:
                if rest.lower().startswith(known + "_"):
                    hint = f"{ENV_PREFIX}{known.upper()}__{rest[len(known) + 1 :]}"
                    raise SettingsError(
                        f"{name} is not a setting: use two underscores after the section, "
                        f"as in {hint}"
                    )
            continue
        layer.setdefault(section.lower(), {})[key.lower()] = (env[name], name)
    return layer


def _merge(
    data: dict[str, dict[str, Any]],
    layer: Mapping[str, Any],
    source: str,
    *,
    from_env: bool,
    named: bool = False,
) -> None:
    """Check each value of ``layer`` against its field and put it into ``data``.

    An environment layer holds ``(value, variable name)`` pairs: the variable is the source;
    so does a ``named`` layer (flags), whose values are typed already.
    """
    named = named or from_env
    for section, values in layer.items():
        if section not in _SECTIONS:
            if not from_env and not isinstance(values, Mapping):
                homes = [name for name, fields in _FIELDS.items() if section in fields]
                where = f"; did you mean [{homes[0]}] {section}?" if homes else ""
                raise SettingsError(
                    f"setting {section} outside any [section] (from {source}){where}"
                )
            origin = _env_names(values) if named else source
            close = difflib.get_close_matches(section, list(_SECTIONS), n=1)
            hint = f"did you mean [{close[0]}]?" if close else "sections: " + ", ".join(_SECTIONS)
            raise SettingsError(f"unknown settings section [{section}] (from {origin}); {hint}")
        if not isinstance(values, Mapping):
            raise SettingsError(
                f"[{section}] must be a table of settings, got {values!r} (from {source})"
            )
        fields = _FIELDS[section]
        for key, raw in values.items():
            value, origin = raw if named else (raw, source)
            name = f"{section}.{key}"
            if key not in fields:
                raise SettingsError(
                    f"unknown setting {name} (from {origin})"
                    f"{_suggest(key, fields, prefix=section + '.')}"
                )
            data.setdefault(section, {})[key] = _coerce(
                section, key, value, fields[key], f"{name}: ", f" (from {origin})", from_env
            )


def _env_names(values: Mapping[str, Any]) -> str:
    return ", ".join(variable for _value, variable in values.values())


def _suggest(word: str, choices: Mapping[str, Any], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _coerce(
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


def physical_memory() -> int:
    """This machine's memory in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


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


def settings_toml(settings: Settings) -> str:
    """The settings as TOML that ``load_settings`` reads back; derived defaults as comments."""
    derived = {
        ("server", "endpoint"): settings.endpoint(),
        ("cache", "arena"): settings.arena_path(),
        ("cache", "journal"): settings.journal_path(),
        ("events", "pod"): settings.events.pod_name(),
        ("events", "endpoint"): "off: no KV events",
        ("events", "replay_endpoint"): "no replay",
        ("events", "socket_mode"): f"the control socket's: {settings.server.socket_mode}",
        ("events", "socket_group"): (
            f"the control socket's: {settings.server.socket_group or 'left as created'}"
        ),
        ("metrics", "address"): "off",
        ("metrics", "socket_group"): "left as created",
    }
    exposed = settings.exposed()
    placed = {
        ("events", "endpoint"): exposed.events.endpoint,
        ("events", "replay_endpoint"): exposed.events.replay_endpoint or "no replay",
        ("metrics", "address"): exposed.metrics.address,
    }
    lines: list[str] = []
    for section in _SECTIONS:
        lines.append(f"[{section}]")
        values = msgspec.to_builtins(getattr(settings, section))
        for key, value in values.items():
            line = f"{key} = {_toml_value(value)}"
            if (section, key) in SIZE_SETTINGS:
                line += f"  # {format_size(value)}"
            elif not value and (section, key) in derived:
                line += f"  # {derived[section, key]}"
            elif value == AUTO and (section, key) in placed:
                line += f"  # {placed[section, key]}"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):  # mooncake.tenants: an inline table, its keys quoted
        items = (f"{_toml_value(key)} = {_toml_value(item)}" for key, item in value.items())
        return "{" + ", ".join(items) + "}"
    # A JSON string is a valid TOML basic string.
    return msgspec.json.encode(str(value)).decode()


# --------------------------------------------------------------------------- logging


def configure_logging(
    log: LogSettings,
    *,
    stream: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> logging.Handler:
    """Send every logger's records at ``log.level`` and above to ``stream`` (stderr).

    Calling it again replaces the handler it installed before; other handlers stay.
    """
    return install_log_handler(log.level, log.format, stream=stream, environ=environ)
