"""Requests and replies between ranks and the daemon: one msgpack frame per message.

Every message is a tagged msgspec Struct (short explicit tags, so renaming a class never
changes the wire). Requests carry a ``request_id`` that their reply echoes; ``JobDone`` and
``EngineReady`` arrive unasked. Fields are only ever appended, with defaults
(``protocol_version`` in ``Hello`` says which revision a peer speaks).

Conversation of one rank:
    Hello -> Welcome (then EngineReady once every rank of the engine said Hello)
    Lookup -> LookupResult
    Store / Load -> JobAccepted, later JobDone(job_id)
    StepJobs (a step's Stores and Loads) -> Ok(count), later one JobDone per job (those
        whose copies ended together in one JobsDone)
    Reserve -> Reserved; UpdateHolds -> HoldResult; Ack -> Ok   (schedulers)
        (a Reserve's or UpdateHolds' ``lookups``: one LookupResult each, after its reply)
    KeysChanged arrives unasked at a scheduler that asked for the key mirror
    Wait -> WaitResult (when the jobs are done or the timeout passes)
    Release / Clear / Ping / Bye -> Ok
    GetStats -> StatsResult
An operator's tool (no session needed, root and the daemon's user only):
    ListCache -> CacheListing; ClearCache -> Ok(chunks dropped)
Any request may instead be answered by Error(code, message, request_id).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.config import OffloadingConfig
from protocol.handles import KVRegion

Role = Literal["worker", "scheduler"]


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """First message of a session: the rank's config and its KV regions.

    Who the sender is comes from its registration (``token``, see ``protocol.peer``), not
    from this message: ``pid`` and ``pid_namespace`` are informational. A scheduler sends no
    regions. Saying Hello again replaces the sender's earlier session (and any other session
    of the same engine, dp index and rank, when it belongs to the same Unix user).
    """

    request_id: int
    protocol_version: int
    role: Role
    config: OffloadingConfig
    regions: tuple[KVRegion, ...] = ()
    device_uuid: str = ""
    pid: int = 0
    client_name: str = ""
    # KV events for this engine (used when config.enable_kv_cache_events): the topic to
    # publish under ("" = the daemon's template) and raw hash bytes instead of vLLM's
    # default low-64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    kv_events_topic: str = ""
    kv_events_raw_hashes: bool = False
    # Inode of the sender's pid namespace (/proc/self/ns/pid). Informational: the daemon
    # watches the process that registered, as the kernel names it.
    pid_namespace: int = 0
    # A scheduler that keeps a mirror of its namespace's committed keys (KeysChanged) and
    # publishes the engine's KV events itself; the daemon then publishes none for the engine.
    # A worker says so for its engine's scheduler, which may connect after it.
    mirror: bool = False
    # The one-time token the registration socket handed this peer (``protocol.peer``): it
    # binds the session to the peer's kernel identity (uid, gid, pid) and to the region
    # descriptors it passed. On an ipc:// endpoint a Hello without a valid one is refused.
    token: bytes = b""
    # The sender's CLOCK_MONOTONIC (time.monotonic()) as it sends this Hello: the daemon
    # compares it with its own to tell the rank whether a Store's ``deadline`` is on a clock
    # both read (``Welcome.shared_clock``). 0: not said (no deadlines then).
    monotonic: float = 0.0


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """``keys`` consecutive keys of one group; their ``blocks`` block ids fill sub-blocks from
    ``skip`` of the first key on, in order (the last chunk may be partly filled)."""

    keys: int
    skip: int
    blocks: int


class HoldKeys(msgspec.Struct, frozen=True, array_like=True):
    """Keys held (or released) for one scheduler request, named by ``token``."""

    token: str
    keys: list[bytes]


class Lookup(msgspec.Struct, frozen=True, tag="lookup"):
    """How many leading ``keys`` are committed; ``pin`` holds those hits for a lease."""

    request_id: int
    keys: list[bytes]
    pin: bool = False
    lease_seconds: float = 0.0  # 0: the daemon's default lease


class Store(msgspec.Struct, frozen=True, tag="store"):
    """Copy this rank's shard of each key from its GPU blocks into the host cache.

    ``block_ids`` holds ``blocks_per_chunk`` ids per key, key after key.
    """

    request_id: int
    job_id: int
    keys: list[bytes]
    block_ids: list[int]
    # A CUDA interprocess event handle (torch.cuda.Event(interprocess=True).ipc_handle())
    # recorded after the compute that wrote these blocks: the copy waits on it. Empty: the
    # rank synchronized its compute stream before sending the Store.
    wait_event: bytes = b""
    # Empty: every key has exactly ``blocks_per_chunk`` block ids. Otherwise the keys in
    # groups of ``Segment``s, each starting mid-chunk and ending with a partial chunk.
    segments: list[Segment] = msgspec.field(default_factory=list)
    # Write only keys a scheduler reserved (``Reserve``); others are skipped, never allocated,
    # so such a store is never refused for lack of room.
    reserved: bool = False
    # The rank's CLOCK_MONOTONIC time after which it may give the store up and reuse the
    # blocks (sent only when ``Welcome.shared_clock``): the daemon starts no store past it and
    # commits none whose copy ended past it. 0: no deadline.
    deadline: float = 0.0
    # With ``reserved``: the scheduler session and the request id of the ``Reserve`` that
    # reserved these keys. The daemon reads the rank's socket and the scheduler's in turns,
    # so it may read this Store first: it then waits for that Reserve (bounded) instead of
    # skipping keys not reserved yet. "": nothing to wait for.
    reserver: str = ""
    reserve_id: int = 0


class Load(msgspec.Struct, frozen=True, tag="load"):
    """Copy committed shards back into this rank's GPU blocks.

    ``skip`` leading blocks of the first chunk are not loaded (a load that starts
    mid-chunk), so ``len(block_ids) == len(keys) * blocks_per_chunk - skip``.
    """

    request_id: int
    job_id: int
    keys: list[bytes]
    block_ids: list[int]
    skip: int = 0
    # A CUDA interprocess event recorded after the rank's last use of these blocks: the copy
    # into them waits on it. Empty: the rank synchronized before sending the Load.
    wait_event: bytes = b""
    # As in ``Store``; when given, ``skip`` is ignored.
    segments: list[Segment] = msgspec.field(default_factory=list)
    # Load the entries a scheduler holds under this token (``UpdateHolds``), which cannot
    # have been evicted, instead of looking the keys up.
    hold: str = ""


class Release(msgspec.Struct, frozen=True, tag="release"):
    """Drop this session's pins on ``keys``."""

    request_id: int
    keys: list[bytes]


class Wait(msgspec.Struct, frozen=True, tag="wait"):
    """Answer once every listed job of this session is done, or after ``timeout`` seconds."""

    request_id: int
    job_ids: list[int]
    timeout: float


class GetStats(msgspec.Struct, frozen=True, tag="stats"):
    """Ask for the daemon's counters.

    A sender without a session may pass a registration ``token`` (``protocol.peer``): the
    engines listed are those its user may see. Without either, no engine. Node-wide
    counters only for root and the daemon's user (``DaemonStats.counters``).
    """

    request_id: int
    token: bytes = b""


class Clear(msgspec.Struct, frozen=True, tag="clear"):
    """Drop every cached chunk of this engine's namespace (a scheduler's cache reset).

    Engines sharing the namespace lose those chunks too; the daemon announces it to them.
    """

    request_id: int


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """A heartbeat: ``session`` (another socket's session id) or the sender's own is alive.

    Sessions whose process the daemon cannot watch are reaped after ``session_timeout``
    seconds without any message; clients send this while idle.
    """

    request_id: int
    session: str = ""


class Bye(msgspec.Struct, frozen=True, tag="bye"):
    """End this session now instead of waiting to be reaped."""

    request_id: int


class Reserve(msgspec.Struct, frozen=True, tag="reserve"):
    """A scheduler reserves room for ``keys`` before its ranks store them (vLLM's
    ``prepare_store``: the plugin sends one per scheduling step, every request's keys in
    one list). Keys already committed or being stored, in this namespace by any engine, are
    not reserved. ``holds`` and ``release`` are applied first (as in ``UpdateHolds``) and
    ``ack`` acknowledged."""

    request_id: int
    keys: list[bytes]
    holds: list[HoldKeys] = msgspec.field(default_factory=list)
    ack: int = 0
    release: list[HoldKeys] = msgspec.field(default_factory=list)
    # The step's tier probes: each handled as if sent alone right after this message, and
    # answered alone (its own request_id; a LookupResult, or an Error), so one message carries
    # a scheduling step whole.
    lookups: list[Lookup] = msgspec.field(default_factory=list)
    # The requester does not wait for the reply (``post_reserve``): it may look keys up
    # before it reads the removals this Reserve causes, so they wait for its acknowledgement
    # like anyone's. False: it reads them first, and they count as acknowledged by it.
    posted: bool = False
    # Committed keys the scheduler's requests used without loading them (its GPU prefix cache
    # had them): touched first, so a prefix one engine keeps using is not evicted from the
    # cache other engines share. Keys not committed are skipped.
    touch: list[bytes] = msgspec.field(default_factory=list)


class UpdateHolds(msgspec.Struct, frozen=True, tag="holds"):
    """Hold committed keys for a request until released (vLLM's ``prepare_load`` /
    ``complete_load``); held keys are never evicted, so their loads cannot miss."""

    request_id: int
    hold: list[HoldKeys] = msgspec.field(default_factory=list)
    release: list[HoldKeys] = msgspec.field(default_factory=list)
    ack: int = 0
    lookups: list[Lookup] = msgspec.field(default_factory=list)  # as in ``Reserve``
    touch: list[bytes] = msgspec.field(default_factory=list)  # as in ``Reserve``


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    """The scheduler has applied every ``KeysChanged`` up to ``seq``."""

    request_id: int
    seq: int


class StepJobs(msgspec.Struct, frozen=True, tag="step_jobs"):
    """A worker rank's Stores and Loads of one scheduling step, in one message.

    Each job is handled as the lone request would be (same checks, same copies, same commit),
    in order, but none is answered ``JobAccepted``: the message gets one ``Ok(count)`` (how
    many jobs started) and every job one ``JobDone``, a job refused before it started
    included (its ``code`` says why). The jobs' own ``request_id`` is not read. Nothing
    waits for the reply: a rank sends it and reads its answers with the notices.
    """

    request_id: int
    jobs: list[Store | Load] = msgspec.field(default_factory=list)


class ListCache(msgspec.Struct, frozen=True, tag="cache_ls"):
    """Ask what the cache holds per namespace and per engine (``offloadd cache ls``).

    Root and the daemon's user only (others: ``NOT_PERMITTED``): it names every tenant's
    engines. A sender without a session passes a registration ``token``, as for GetStats.
    """

    request_id: int
    token: bytes = b""


class ClearCache(msgspec.Struct, frozen=True, tag="cache_clear"):
    """Drop cached chunks (``offloadd cache clear``): every chunk (``all``), those of
    ``namespace``, or those of the namespace engine ``engine_id`` uses (any dp index; engines
    of the same model and tenant share it, so they lose those chunks too). Exactly one of the
    three. Who may: as ``ListCache``. Engines then miss those keys; each engine of a cleared
    namespace that wants KV events hears the removals (``BlockRemoved``: its GPU cache is
    untouched, so not ``AllBlocksCleared``).
    """

    request_id: int
    token: bytes = b""
    all: bool = False
    namespace: str = ""
    engine_id: str = ""


Request = (
    Hello
    | Lookup
    | Store
    | Load
    | Release
    | Wait
    | GetStats
    | Clear
    | Ping
    | Bye
    | Reserve
    | UpdateHolds
    | Ack
    | StepJobs
    | ListCache
    | ClearCache
)


class EngineState(msgspec.Struct, frozen=True):
    """An engine as the daemon sees it: ready once all ``world_size`` ranks said Hello."""

    engine_id: str
    data_parallel_index: int
    world_size: int
    ready: bool
    ranks_present: list[int]
    namespace: str = ""  # set once ready: engines with the same namespace share chunks
    schedulers: int = 0


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    """Reply to Hello: the session is registered."""

    request_id: int
    protocol_version: int
    session_id: str
    engine: EngineState
    # Where this engine's KV events are published (its dp index's publisher) and its replay
    # socket; "" when the daemon publishes no events (or no replay).
    events_endpoint: str = ""
    events_replay_endpoint: str = ""
    # The tiers below the daemon's arena ("disk", "mooncake"): a Lookup may then report keys
    # as pending while it promotes them from one.
    tiers: list[str] = []
    # The Hello's ``monotonic`` was within 1 s of the daemon's own at receipt: the two read
    # one CLOCK_MONOTONIC (no time namespace between them), so a Store may carry a deadline.
    shared_clock: bool = False


class EngineReady(msgspec.Struct, frozen=True, tag="ready"):
    """Sent unasked to every session of an engine when its last rank arrives."""

    engine: EngineState


class LookupResult(msgspec.Struct, frozen=True, tag="lookup_r"):
    """``hits`` leading keys are committed; ``pending`` are indices of keys still being stored."""

    request_id: int
    hits: int
    pending: list[int]
    pinned: int = 0


class JobAccepted(msgspec.Struct, frozen=True, tag="accepted"):
    """The Store or Load passed validation; its JobDone follows."""

    request_id: int
    job_id: int


class JobDone(msgspec.Struct, frozen=True, tag="done"):
    """A job finished. ``ok`` is false when any key failed (refused store, missing load key).

    Keys in ``failed_keys`` were not stored (no room) or not loaded (missing); for a load the
    GPU blocks of failed keys hold no valid data and must be recomputed.
    """

    job_id: int
    ok: bool
    failed_keys: list[bytes]
    nbytes: int
    seconds: float
    error: str = ""
    # A job of a StepJobs that the daemon refused before it started: the ErrorCode it would
    # have answered a lone Store or Load with (0: the job ran).
    code: int = 0


class JobsDone(msgspec.Struct, frozen=True, tag="dones"):
    """Jobs of one StepJobs that finished together (their copy was one): each one's JobDone,
    in one frame, so that a rank polling meanwhile sees all of them or none."""

    dones: list[JobDone]


class Reserved(msgspec.Struct, frozen=True, tag="reserved"):
    """Reply to Reserve: indices of the keys that got room (the ranks now store them);
    ``missing``: the held keys that were not held (as ``HoldResult.missing``; a daemon
    before this field sends none)."""

    request_id: int
    reserved: list[int]
    missing: list[bytes] = []


class HoldResult(msgspec.Struct, frozen=True, tag="holds_r"):
    """Reply to UpdateHolds: ``held`` keys newly held; ``missing`` were not committed."""

    request_id: int
    held: int
    missing: list[bytes]


class KeysChanged(msgspec.Struct, frozen=True, tag="keys"):
    """Committed keys of a mirroring scheduler's namespace that appeared or went away.

    Sent unasked, in order. ``reset`` starts a full snapshot that replaces the mirror and
    continues while ``more``. Space of removed keys is reused only once every mirroring
    scheduler acknowledged ``seq`` (or held the key), so a key still in a mirror stays
    loadable.
    """

    seq: int
    stored: list[bytes]
    removed: list[bytes]
    reset: bool = False
    more: bool = False


class WaitResult(msgspec.Struct, frozen=True, tag="wait_r"):
    """Jobs that finished (with their outcome) and those still running at the timeout."""

    request_id: int
    done: list[JobDone]
    pending: list[int]


class TierState(msgspec.Struct, frozen=True):
    """One tier below the arena (``[disk]``, ``[mooncake]``): its fill and its counters."""

    name: str
    capacity: int
    used_bytes: int
    chunks: int
    healthy: bool = True  # False while its medium is unreachable
    errors: int = 0  # faults of the medium and copies that failed
    hits: int = 0  # keys lookups found here (and asked to promote)
    promotions: int = 0  # chunks promoted into the arena, every byte verified
    promotion_failures: int = 0  # chunks gone from the tier or failing verification: never served
    demotions: int = 0  # committed chunks written here
    demotions_skipped: int = 0  # chunks not written: the queue to the tier was full
    queued_bytes: int = 0  # chunks waiting for the tier (held in the arena)
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0  # time spent in writes, for GB/s
    read_seconds: float = 0.0


# The reasons ``DaemonStats.stores_refused_by_reason`` may carry (metrics export each, 0 included).
REFUSAL_REASONS = ("full", "ack", "budget", "tenant", "expired", "draining", "late", "waiting")


class DaemonStats(msgspec.Struct, frozen=True):
    """Counters since the daemon started."""

    uptime_seconds: float
    capacity_bytes: int
    used_bytes: int
    entries: int
    committed_entries: int
    lookups: int
    hits: int
    misses: int
    stores_refused: int
    evictions: int
    bytes_stored: int
    bytes_loaded: int
    protocol_errors: int
    sessions: int
    engines: list[EngineState]
    imports: int = 0  # memory handles currently mapped (closed when their sessions end)
    jobs_in_flight: int = 0
    # Where KV events are published (dp index 0's publisher) and replayed; "" when off.
    events_endpoint: str = ""
    events_replay_endpoint: str = ""
    # The cuda engine's fast path, {"batched": ..., "pinned": ...}: a False is a degraded
    # daemon (status and metrics say so). Empty on the cpu engine.
    copy_path: dict[str, bool] = {}
    tiers: list[TierState] = []  # the tiers below the arena, in order (empty: none)
    version: str = ""  # the daemon's offloadd version
    pid: int = 0
    arena: str = ""  # the arena file's path
    copy_engine: str = ""  # "cpu" or "cuda", as chosen at start
    # Keys refused by reason: "full" (nothing evictable), "ack" (reserved, but the room a
    # mirror's acknowledgement was to free came after the ranks stored), "budget" (beyond the
    # engine's protected share; not in ``stores_refused``), "tenant" (beyond the share of the
    # engine's tenant, all its engines together; not in it either), "expired" (reserved, not
    # stored within limits.reservation_seconds, dropped), "draining" (reserved or stored while
    # the daemon was stopping; not in ``stores_refused``), "late" (a store's deadline passed
    # before it started or before its copy ended: not committed; not in ``stores_refused``).
    # Empty from a daemon before it.
    stores_refused_by_reason: dict[str, int] = {}
    # False: the node-wide counters (cache fill, lookups, bytes, sessions, tiers' counts) are
    # withheld from this asker and read 0: they add up every tenant's work, so only root and
    # the daemon's user see them. True from a daemon before this field.
    counters: bool = True
    # Schedulers ended because their key mirror did not acknowledge removals within
    # server.mirror_ack_timeout (counted since start), and rank stores waiting now for the
    # room another mirror's acknowledgement frees. Node-wide: 0 where ``counters`` is False.
    mirrors_dropped: int = 0
    stores_waiting: int = 0
    # Load jobs that failed because keys they read were gone (their engine recomputes those
    # requests, or fails them under vLLM's kv_load_failure_policy "fail"). Node-wide.
    loads_missing: int = 0


class StatsResult(msgspec.Struct, frozen=True, tag="stats_r"):
    """Reply to GetStats."""

    request_id: int
    stats: DaemonStats


class NamespaceUsage(msgspec.Struct, frozen=True):
    """One namespace in ``CacheListing``: committed chunks and their bytes now; hits, misses
    (keys its engines' lookups found or not) and ``last_use`` (Unix time of its engines'
    latest lookup, store or load; 0: none) since the daemon started."""

    name: str
    tenant: str  # whose engines made it ("u<uid>", "g<gid>", ...; "" when not known)
    chunks: int
    nbytes: int
    hits: int = 0
    misses: int = 0
    last_use: float = 0.0
    engines: list[str] = []  # "engine_id/dp" of the engines that used it, connected or not


class EngineUsage(msgspec.Struct, frozen=True):
    """One engine in ``CacheListing``: its namespace, its own hits, misses and last use."""

    engine_id: str
    data_parallel_index: int
    namespace: str
    connected: bool
    hits: int = 0
    misses: int = 0
    last_use: float = 0.0


class CacheListing(msgspec.Struct, frozen=True, tag="cache_ls_r"):
    """Reply to ListCache: namespaces by name, engines by id and dp index."""

    request_id: int
    namespaces: list[NamespaceUsage]
    engines: list[EngineUsage]


class Ok(msgspec.Struct, frozen=True, tag="ok"):
    """Plain acknowledgement (Release: ``count`` pins dropped; Bye)."""

    request_id: int
    count: int = 0


class Error(msgspec.Struct, frozen=True, tag="error"):
    """The request failed; ``code`` is a ``protocol.errors.ErrorCode`` value.

    ``request_id`` is 0 when the request could not be decoded far enough to know it.
    """

    request_id: int
    code: int
    message: str


Reply = (
    Welcome
    | EngineReady
    | LookupResult
    | JobAccepted
    | JobDone
    | JobsDone
    | WaitResult
    | StatsResult
    | Ok
    | Error
    | Reserved
    | HoldResult
    | KeysChanged
    | CacheListing
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Request | Reply) -> bytes:
    """One msgpack frame for ``message``."""
    return _encoder.encode(message)


def decode_request(frame: bytes | memoryview) -> Request:
    """Decode a request; raises ``msgspec.DecodeError`` / ``ValidationError`` on bad input."""
    try:
        return _request_decoder.decode(frame)
    except RecursionError:
        raise _too_deep() from None


def decode_reply(frame: bytes | memoryview) -> Reply:
    """Decode a reply; raises ``msgspec.DecodeError`` / ``ValidationError`` on bad input."""
    try:
        return _reply_decoder.decode(frame)
    except RecursionError:
        raise _too_deep() from None


def _too_deep() -> msgspec.DecodeError:
    # msgspec gives up on deep nesting (a few bytes per level) with RecursionError; to a
    # caller that is just another malformed frame.
    return msgspec.DecodeError("MessagePack data is nested too deeply")


def peek_request_id(frame: bytes | memoryview) -> int:
    """Best-effort ``request_id`` of a frame that failed to decode as a request (else 0)."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        return 0
    if isinstance(raw, dict):
        value = raw.get("request_id")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0
