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
(``parse_size``). The checks of each value are in ``offloadd.settings_check``.
"""

from __future__ import annotations

import difflib
import logging
import os
import socket
import tomllib
from collections.abc import Mapping
from typing import IO, Any, Literal

import msgspec

from offloadd.endpoint import default_endpoint, ipc_path, replay_beside, state_dir
from offloadd.logs import install_log_handler
from offloadd.settings_check import (
    AUTO,
    ENDPOINT_EXAMPLES,
    EVENTS_SUFFIX,
    MAX_UID,
    METRICS_SUFFIX,
    MIN_CAPACITY,
    REPLAY_SUFFIX,
    SIZE_SETTINGS,
    UNIX_PREFIX,
    AmbiguousSize,
    SettingsError,
    coerce,
    endpoint_problem,
    format_size,
    log_level_problem,
    parse_address,
    parse_size,
)

__all__ = [
    "AUTO",
    "ENDPOINT_EXAMPLES",
    "ENV_PREFIX",
    "EVENTS_SUFFIX",
    "MAX_UID",
    "METRICS_SUFFIX",
    "MIN_CAPACITY",
    "REPLAY_SUFFIX",
    "SETTINGS_SECTIONS",
    "SIZE_SETTINGS",
    "UNIX_PREFIX",
    "AmbiguousSize",
    "CacheSettings",
    "DiskSettings",
    "EventSettings",
    "LimitsSettings",
    "LogSettings",
    "MetricsSettings",
    "MooncakeSettings",
    "ServerSettings",
    "Settings",
    "SettingsError",
    "TenancySettings",
    "configure_logging",
    "default_arena_dir",
    "endpoint_problem",
    "format_size",
    "load_settings",
    "log_level_problem",
    "parse_address",
    "parse_size",
    "physical_memory",
    "settings_toml",
]


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


def physical_memory() -> int:
    """This machine's memory in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


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
            data.setdefault(section, {})[key] = coerce(
                section, key, value, fields[key], f"{name}: ", f" (from {origin})", from_env
            )


def _env_names(values: Mapping[str, Any]) -> str:
    return ", ".join(variable for _value, variable in values.values())


def _suggest(word: str, choices: Mapping[str, Any], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


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
