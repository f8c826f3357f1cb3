"""Trust nothing a client says (issue 15): each attack as it was found, against a real daemon
(and a real second Unix user where it needs one), is refused or survived, and no wrong byte is
served.

1. Confused deputy: the daemon opened a region's PATH with its own rights.
2. Any client could kill the daemon with SIGBUS: truncate a registered file, or leave holes
   in a full tmpfs, then send a Store or Load.
4. Identity was self-declared: a Hello replaced another user's session; namespaces, events
   topics and GetStats trusted what the client said.
5. No bounds per client: a Hello's pid, pins and leases, errors in the middle of a Hello,
   key sizes, jobs, regions, sessions and registrations.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import itertools
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch
import zmq
from prometheus_client import generate_latest

import offloadd.peer
import offloadd.server.control
import offloadd.server.lanes
import offloadd.transfer.guarded
import offloadd.transfer.handles
from offloadd.cache.arena import Arena
from offloadd.client import OffloadClient
from offloadd.errors import (
    InvalidRequest,
    JobError,
    NotPermitted,
    OffloaddError,
    RequestFailed,
)
from offloadd.peer import register
from offloadd.server.control import RCVHWM
from offloadd.settings import (
    DiskSettings,
    EventSettings,
    LimitsSettings,
    MetricsSettings,
    ServerSettings,
    TenancySettings,
)
from offloadd.shm import SharedKVTensor
from offloadd.tiers import chunkfile
from offloadd.tiers.base import ChunkAddress
from offloadd.tiers.disk import DiskTier
from protocol import PROTOCOL_VERSION
from protocol.errors import ErrorCode
from protocol.handles import KVRegion, ShmHandle
from protocol.messages import (
    Error,
    GetStats,
    Hello,
    Reply,
    Request,
    StatsResult,
    Store,
    Welcome,
    decode_reply,
    encode,
)
from tests.fakes import FakeCopyEngine
from tests.helpers import held_report, system_group, tmpfs
from tests.integration.harness import (
    DaemonThread,
    Rank,
    ServeProcess,
    chain_keys,
    chunk_block_ids,
    make_config,
    make_rank,
    scrape_unix,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_GROUP = "odtrust-shared"
USER_NAMES = ("odtrust-a", "odtrust-b")
PAGE = 4096
BPC = 2

DaemonFactory = Callable[..., DaemonThread]


# ---------------------------------------------------------------- helpers


class RawPeer:
    """A DEALER with a known routing id, for Hellos and requests the client would not send."""

    def __init__(self, endpoint: str, identity: bytes | None = None) -> None:
        self.endpoint = endpoint
        self.identity = identity or uuid.uuid4().bytes
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        self.sock.connect(endpoint)

    def token(self, fds: list[int] | None = None) -> bytes:
        registered = register(self.endpoint, self.identity, fds or [])
        assert registered is not None
        return registered.token

    def ask(self, request: Request) -> Reply:
        self.sock.send(encode(request))
        while True:
            assert self.sock.poll(10_000), "the daemon did not answer"
            reply = decode_reply(self.sock.recv())
            if getattr(reply, "request_id", None) == request.request_id:
                return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _admin_stats(endpoint: str) -> list[str]:
    """Engine ids as root (an admin) sees them."""
    with OffloadClient(endpoint, heartbeat=0) as client:
        return sorted(engine.engine_id for engine in client.stats().engines)


def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in time"
        time.sleep(0.01)


@pytest.fixture
def workdir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="od-trust-", dir="/tmp")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------- two Unix users


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int  # primary group


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, User]]:
    """Two real users, each with its own primary group, both in SHARED_GROUP (which may reach
    the daemon's socket). Made with useradd for this module, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making two Unix users (useradd) needs root")
    if shutil.which("useradd") is None:
        pytest.skip("no useradd on this host")
    made_users: list[str] = []
    with system_group(SHARED_GROUP), _removing(made_users):
        for name in USER_NAMES:
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(
                    ["useradd", "--system", "--user-group", "--no-create-home",
                     "--shell", "/usr/sbin/nologin", "--groups", SHARED_GROUP, name],
                    check=True,
                )  # fmt: skip
                made_users.append(name)
        yield {
            name: User(name, pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid)
            for name in USER_NAMES
        }


@contextlib.contextmanager
def _removing(users: list[str]) -> Iterator[None]:
    """``userdel`` each of ``users`` (those this module made) when the block ends."""
    try:
        yield
    finally:
        for name in users:
            subprocess.run(["userdel", name], check=False)


@pytest.fixture
def shared_dir(users: dict[str, User]) -> Iterator[str]:
    """A socket directory root owns and SHARED_GROUP may enter (as /run/offloadd is)."""
    directory = tempfile.mkdtemp(prefix="od-trust-", dir="/tmp")
    os.chown(directory, 0, grp.getgrnam(SHARED_GROUP).gr_gid)
    os.chmod(directory, 0o750)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def shared_daemon(shared_dir: str) -> Iterator[Callable[..., DaemonThread]]:
    """Daemons (as root) whose sockets SHARED_GROUP may use."""
    started: list[DaemonThread] = []

    def start(**settings: Any) -> DaemonThread:
        name = f"d{len(started)}.sock"
        daemon = DaemonThread(
            endpoint=f"ipc://{shared_dir}/{name}", socket_group=SHARED_GROUP, **settings
        ).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


def _as_user(
    user: User, endpoint: str, *options: str, group: int | None = None
) -> subprocess.Popen[str]:
    """peer_process as ``user`` (its primary group, or ``group``), in SHARED_GROUP too."""
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    identity = ["--user", str(user.uid), "--group", str(user.gid if group is None else group)]
    identity += ["--groups", str(shared)]
    command = [sys.executable, "-m", "tests.integration.peer_process", endpoint, *identity]
    env = {"PYTHONPATH": REPO, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.Popen(
        [*command, *options],
        env={**env, "PYTHONDONTWRITEBYTECODE": "1"},
        cwd="/tmp",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_as(user: User, endpoint: str, *options: str, group: int | None = None) -> dict[str, object]:
    """Run peer_process as ``user``; its JSON report."""
    process = _as_user(user, endpoint, *options, group=group)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    report: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    assert report["uid"] == user.uid
    return report


@contextlib.contextmanager
def held_as(
    user: User, endpoint: str, *options: str, group: int | None = None
) -> Iterator[dict[str, object]]:
    """peer_process as ``user`` keeping its session until the block ends."""
    with held_report(_as_user(user, endpoint, *options, "--hold", group=group)) as report:
        yield report


# ---------------------------------------------------------------- 1. confused deputy


def test_another_users_0600_file_is_out_of_reach(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    daemon = shared_daemon()
    a, b = users["odtrust-a"], users["odtrust-b"]
    victim = f"/dev/shm/od-test-victim-{uuid.uuid4().hex[:8]}"
    secret = os.urandom(PAGE)
    fd = os.open(victim, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd, secret, 0)
        os.fchown(fd, a.uid, a.gid)
        # B cannot open A's file; naming its path gets B nothing: the daemon, root here,
        # opens no path for anybody.
        report = run_as(b, daemon.endpoint, "--open", victim, "--path-hello", victim)
        assert report["opened"] == "Permission denied"
        assert report["path_hello"] == ErrorCode.HANDLE_OPEN_FAILED
        # Not even root's own client can make the daemon open a path for it.
        from tests.integration.peer_process import _path_hello

        assert _path_hello(daemon.endpoint, victim) == ErrorCode.HANDLE_OPEN_FAILED
        with OffloadClient(daemon.endpoint, heartbeat=0) as viewer:
            assert viewer.stats().imports == 0
        assert os.pread(fd, PAGE, 0) == secret
    finally:
        os.close(fd)
        os.unlink(victim)


def test_the_daemons_own_files_cannot_be_regions(workdir: str) -> None:
    # A journal on tmpfs (outside shm_dirs), so that only the device-and-inode check stands
    # between a rank and it; the rank here is root, who could open anything.
    state = tempfile.mkdtemp(prefix="od-test-state-", dir="/dev/shm")
    daemon = DaemonThread()
    cache = msgspec.structs.replace(
        daemon.settings.cache, persist=True, journal=f"{state}/d.journal"
    )
    server = msgspec.structs.replace(daemon.settings.server, shm_dirs=(f"{workdir}/shm",))
    daemon.settings = msgspec.structs.replace(daemon.settings, cache=cache, server=server)
    daemon.start()
    link = f"/dev/shm/od-test-link-{uuid.uuid4().hex[:8]}"
    try:
        os.symlink(daemon.arena_path, link)
        config = make_config(tp=1, bytes_per_block=0)
        for path in (daemon.arena_path, link, f"{state}/d.journal", f"{state}/d.journal.key"):
            region = KVRegion(ShmHandle(path, 0, 32), 1, 32, 32, ("layer.0",))
            with pytest.raises(InvalidRequest, match="daemon's own files"):
                OffloadClient.connect(daemon.endpoint, config, [region], heartbeat=0)
        with OffloadClient(daemon.endpoint, heartbeat=0) as viewer:
            assert viewer.stats().imports == 0
    finally:
        daemon.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        shutil.rmtree(state, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(daemon.arena_path)


# ---------------------------------------------------------------- 2. SIGBUS


def _store(rank: Rank, keys: list[bytes], chunks: range, job: int = 1) -> None:
    assert rank.client is not None
    rank.client.store(job, keys, chunk_block_ids(chunks, BPC))
    rank.client.wait([job], 10)


def test_a_rank_truncating_its_file_fails_its_own_jobs_not_the_daemon(workdir: str) -> None:
    server = ServeProcess(workdir, f"/dev/shm/od-test-trust-{uuid.uuid4().hex[:12]}")
    ranks: list[Rank] = []
    try:
        server.start()
        truncating = make_rank(server.endpoint, tp=1, engine_id="truncating")
        bystander = make_rank(server.endpoint, tp=1, engine_id="bystander", model="test/other")
        ranks += [truncating, bystander]
        truncating.fill(1)
        bystander.fill(2)
        keys = chain_keys(4, b"truncating")
        _store(truncating, keys, range(4))
        before = [pages.clone() for pages in truncating.pages(chunk_block_ids(range(4), BPC))]
        full = os.stat(truncating.tensors[0].path).st_size
        # Nothing in this process touches the mapping while the file is short (that would
        # fault here): the daemon must neither.
        os.truncate(truncating.tensors[0].path, 8 * PAGE)
        assert truncating.client is not None
        with pytest.raises(InvalidRequest, match="shrank"):
            truncating.client.store(2, chain_keys(2, b"more"), chunk_block_ids(range(2), BPC))
        with pytest.raises(InvalidRequest, match="shrank"):
            truncating.client.load(3, keys, chunk_block_ids(range(4), BPC, 100))
        # Everyone else is served as before.
        other = chain_keys(4, b"bystander")
        _store(bystander, other, range(4))
        assert bystander.client is not None
        bystander.client.load(4, other, chunk_block_ids(range(4), BPC, 100))
        bystander.client.wait([4], 10)
        assert server.process is not None and server.process.poll() is None
        # The file whole again: the chunks stored before come back byte for byte.
        os.truncate(truncating.tensors[0].path, full)
        truncating.client.load(5, keys, chunk_block_ids(range(4), BPC, 100))
        truncating.client.wait([5], 10)
        after = truncating.pages(chunk_block_ids(range(4), BPC, 100))
        for got, want in zip(after, before, strict=True):
            assert torch.equal(got, want)
    finally:
        for rank in ranks:
            rank.close()
        server.cleanup()


def test_a_file_truncated_under_a_running_copy_fails_that_job(
    daemon_factory: DaemonFactory, ranks: list[Rank]
) -> None:
    gated = FakeCopyEngine()
    daemon = daemon_factory(copy_engine=gated)
    rank = make_rank(daemon.endpoint, tp=1)
    ranks.append(rank)
    rank.fill(3)
    assert rank.client is not None
    keys = chain_keys(4, b"under-a-copy")
    path = rank.tensors[1].path
    full = os.stat(path).st_size
    gated.gate.clear()
    rank.client.store(1, keys, chunk_block_ids(range(4), BPC))  # checked whole, then cut
    assert gated.started.acquire(timeout=10)
    os.truncate(path, 0)
    gated.gate.set()
    with pytest.raises(JobError) as failed:
        rank.client.wait([1], 10)
    assert "shrank" in failed.value.results[0].error
    assert rank.client.lookup(keys).hits == 0  # nothing it half-read was committed
    # This very process (the daemon's) is alive; the rank's file whole again, it stores.
    os.truncate(path, full)
    _store(rank, chain_keys(1, b"whole"), range(1))


@pytest.fixture
def small_tmpfs() -> Iterator[str]:
    """A 256 KiB tmpfs of its own, filled up by the test (never /dev/shm, which is shared)."""
    with tmpfs("256k", "0755", "od-tmpfs-") as directory:
        yield directory


def _fill(directory: str) -> None:
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\xff" * PAGE)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_sparse_region_on_a_full_tmpfs(
    small_tmpfs: str, workdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ServeProcess(workdir, f"/dev/shm/od-test-trust-{uuid.uuid4().hex[:12]}")
    files: list[SharedKVTensor] = []
    try:
        server.start()
        files += [
            SharedKVTensor.create(16, PAGE, [layer], directory=small_tmpfs, prefix="od-test")
            for layer in ("layer.0", "layer.1", "layer.2")
        ]  # sparse: nothing touched them
        _fill(small_tmpfs)
        config = make_config(tp=1, bytes_per_block=3 * PAGE)
        regions = [kv.region for kv in files]
        # The client gives its regions pages before registering: refused here, with ENOSPC.
        with pytest.raises(OffloaddError, match="No space left"):
            OffloadClient.connect(server.endpoint, config, regions, heartbeat=0)
        # A client that skips that: the daemon takes the sparse file, and its copies into
        # the holes fail the job instead of faulting.
        monkeypatch.setattr(offloadd.peer, "_allocate", lambda fd, path, end: None)
        with OffloadClient.connect(server.endpoint, config, regions, heartbeat=0) as client:
            keys = chain_keys(2, b"sparse")
            client.store(1, keys, chunk_block_ids(range(2), BPC))  # holes read as zeros
            client.wait([1], 10)
            client.load(2, keys, chunk_block_ids(range(2), BPC, 4))
            with pytest.raises(JobError) as failed:
                client.wait([2], 10)
            assert "No space left" in failed.value.results[0].error
            assert client.lookup(keys).hits == 2  # the cache itself is fine
        assert server.process is not None and server.process.poll() is None
    finally:
        for kv in files:
            with contextlib.suppress(BufferError):
                kv.close()
        server.cleanup()


# ---------------------------------------------------------------- 4. identity


def test_a_hello_cannot_take_over_another_users_engine(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    daemon = shared_daemon()
    a, b = users["odtrust-a"], users["odtrust-b"]
    with held_as(a, daemon.endpoint, "--engine", "victim", "--tp", "2", "--rank", "0") as held:
        assert held.get("connected"), held
        # Same engine id and rank: once this replaced A's live session.
        report = run_as(b, daemon.endpoint, "--engine", "victim", "--tp", "2", "--rank", "0")
        assert str(report["error"]).startswith("NotPermitted"), report
        # Another rank of it: joining another user's engine is refused as well.
        report = run_as(b, daemon.endpoint, "--engine", "victim", "--tp", "2", "--rank", "1")
        assert "belongs to another user" in str(report["error"]), report
        # A's session is untouched: still rank 0 of its engine, still one session.
        with OffloadClient(daemon.endpoint, heartbeat=0) as viewer:
            stats = viewer.stats()
        (victim,) = [e for e in stats.engines if e.engine_id == "victim"]
        assert victim.ranks_present == [0] and stats.sessions == 1


def test_chunks_are_shared_within_a_user_only_unless_configured(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared_gid = grp.getgrnam(SHARED_GROUP).gr_gid
    for tenancy, group, shared in (
        (TenancySettings(), None, False),
        (TenancySettings(share_across_uids=True), None, True),
        (TenancySettings(shared_groups=(SHARED_GROUP,)), shared_gid, True),
        (TenancySettings(shared_groups=(SHARED_GROUP,)), None, False),  # not their primary
    ):
        daemon = shared_daemon(tenancy=tenancy)
        # B plants chunks under a guessable key in what would be a shared namespace.
        planted = run_as(
            b, daemon.endpoint, "--engine", "b-engine", "--store", "planted", group=group
        )
        assert planted["stored"] == 4
        # A, same model and layout, looks them up.
        seen = run_as(
            a, daemon.endpoint, "--engine", "a-engine", "--lookup", "planted", group=group
        )
        assert seen["hits"] == (4 if shared else 0), (tenancy, seen)
        assert (seen["namespace"] == planted["namespace"]) is shared
        # Within one user, engines of one model share as before.
        again = run_as(
            b, daemon.endpoint, "--engine", "b-again", "--lookup", "planted", group=group
        )
        assert again["hits"] == 4


def test_getstats_shows_each_peer_what_it_may_see(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    daemon = shared_daemon()
    a, b = users["odtrust-a"], users["odtrust-b"]
    with (
        held_as(a, daemon.endpoint, "--engine", "a-engine") as held_a,
        held_as(b, daemon.endpoint, "--engine", "b-engine") as held_b,
    ):
        assert held_a.get("connected") and held_b.get("connected")
        assert run_as(b, daemon.endpoint, "--stats")["engines"] == ["b-engine"]
        assert run_as(a, daemon.endpoint, "--stats")["engines"] == ["a-engine"]
        assert _admin_stats(daemon.endpoint) == ["a-engine", "b-engine"]  # root
        # Without a session or a registration: no engine, and no tenant's counters.
        peer = RawPeer(daemon.endpoint)
        try:
            reply = peer.ask(GetStats(7))
        finally:
            peer.close()
        assert isinstance(reply, StatsResult)
        assert reply.stats.engines == [] and reply.stats.sessions == 0
        assert reply.stats.counters is False


def test_private_cache_is_private_per_user_too(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    # Even with every user in one tenant, private_cache hashes the kernel's uid: B naming
    # A's engine id elsewhere (another daemon, a restart) never lands in A's namespace.
    a, b = users["odtrust-a"], users["odtrust-b"]
    daemon = shared_daemon(tenancy=TenancySettings(share_across_uids=True))
    first = run_as(a, daemon.endpoint, "--engine", "same-id", "--private", "--store", "p")
    second = run_as(b, daemon.endpoint, "--engine", "same-id", "--private", "--lookup", "p")
    assert first["stored"] == 4 and second["hits"] == 0
    assert first["namespace"] != second["namespace"]


def test_hello_tokens_are_one_time_and_bound_to_their_sender(daemon: DaemonThread) -> None:
    sender, other = RawPeer(daemon.endpoint), RawPeer(daemon.endpoint)
    try:
        hello = Hello(1, PROTOCOL_VERSION, "scheduler", make_config(engine_id="tokens", tp=1))
        refused = sender.ask(hello)
        assert isinstance(refused, Error) and refused.code == ErrorCode.UNAUTHENTICATED
        token = sender.token()
        stolen = other.ask(msgspec.structs.replace(hello, token=token))
        assert isinstance(stolen, Error) and stolen.code == ErrorCode.UNAUTHENTICATED
        replayed = sender.ask(msgspec.structs.replace(hello, token=token))  # burned above
        assert isinstance(replayed, Error) and replayed.code == ErrorCode.UNAUTHENTICATED
        fresh = sender.token()
        assert isinstance(sender.ask(msgspec.structs.replace(hello, token=fresh)), Welcome)
        again = sender.ask(msgspec.structs.replace(hello, request_id=2, token=fresh))
        assert isinstance(again, Error) and again.code == ErrorCode.UNAUTHENTICATED
    finally:
        sender.close()
        other.close()


def test_events_go_out_under_the_daemons_topics(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    config = make_config(tp=1, events=True)
    elsewhere = "kv@some-other-pod@test/model"
    with pytest.raises(NotPermitted, match="its own topics"):
        OffloadClient.connect(
            daemon.endpoint, config, role="scheduler", events_topic=elsewhere, heartbeat=0
        )
    # The topic the template gives (the tenant in it) is fine to name; with
    # tenancy.client_topics, any.
    own = f"kv@test-pod/u{os.geteuid()}@test/model"
    with OffloadClient.connect(daemon.endpoint, config, role="scheduler", events_topic=own):
        pass
    free = daemon_factory(tenancy=TenancySettings(client_topics=True))
    with OffloadClient.connect(
        free.endpoint, config, role="scheduler", events_topic=elsewhere, heartbeat=0
    ):
        pass


# ---------------------------------------------------------------- 5. bounds


def test_the_kernels_pid_is_watched_not_the_hellos(daemon: DaemonThread) -> None:
    # pid 1 never exits: a session that claimed it was never reaped.
    command = [
        sys.executable, "-m", "tests.integration.peer_process", daemon.endpoint,
        "--engine", "pid-liar", "--claim-pid", "1", "--hold",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        report = json.loads(process.stdout.readline())
        assert report["connected"]
        assert _admin_stats(daemon.endpoint) == ["pid-liar"]
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        _until(lambda: _admin_stats(daemon.endpoint) == [], "reaping the killed rank")
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)
        for leftover in os.listdir("/dev/shm"):
            if leftover.startswith(f"od-test-{process.pid}-"):
                os.unlink(f"/dev/shm/{leftover}")


@pytest.mark.parametrize("failure", ["mapping", "bug"])
def test_an_error_in_the_middle_of_a_hello_leaks_nothing(
    daemon: DaemonThread, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    real = offloadd.transfer.guarded.reserve  # what handles imported
    calls = []

    def second_fails(size: int) -> int:
        calls.append(size)
        if len(calls) == 2:
            if failure == "mapping":
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            raise RuntimeError("a bug while opening a region")
        return real(size)

    monkeypatch.setattr(offloadd.transfer.handles, "reserve", second_fails)
    expected = InvalidRequest if failure == "mapping" else RequestFailed
    with pytest.raises(expected, match="Cannot allocate" if failure == "mapping" else "INTERNAL"):
        make_rank(daemon.endpoint, tp=1, engine_id="half-opened")
    assert len(calls) == 2
    with OffloadClient(daemon.endpoint, heartbeat=0) as viewer:
        stats = viewer.stats()
    assert stats.imports == 0 and stats.sessions == 0
    # Every descriptor it passed, and the one kept for the first region, is closed again.
    assert _open_kv_files() == []


def _open_kv_files() -> list[str]:
    """Test KV files this process (daemon thread included) still has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/dev/shm/od-test"):
                found.append(target)
    return found


def test_pins_and_leases_are_bounded_per_engine(
    daemon_factory: DaemonFactory, ranks: list[Rank]
) -> None:
    chunk = BPC * PAGE * 3  # one tp=1 rank's chunk: three layers
    daemon = daemon_factory(capacity=8 * chunk)  # protected_fraction 0.5: 4 chunks per engine
    greedy = make_rank(daemon.endpoint, tp=1, engine_id="greedy")
    other = make_rank(daemon.endpoint, tp=1, engine_id="other", model="test/other")
    ranks += [greedy, other]
    greedy.fill(5)
    other.fill(6)
    keys = chain_keys(8, b"greedy")
    _store(greedy, keys, range(8))
    assert greedy.client is not None
    pinned = greedy.client.lookup(keys, pin=True, lease=1e12)
    assert (pinned.hits, pinned.pinned) == (8, 4)
    # Another engine still finds room: the unpinned half is evicted, the pinned half stays.
    theirs = chain_keys(4, b"other")
    _store(other, theirs, range(4))
    assert other.client is not None
    assert other.client.lookup(theirs).hits == 4
    assert greedy.client.lookup(keys[:4]).hits == 4
    with pytest.raises(InvalidRequest, match="lease_seconds"):
        greedy.client.lookup(keys, pin=True, lease=float("nan"))


def test_long_keys_are_refused_before_they_are_kept(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    rank = make_rank(daemon.endpoint, tp=1)
    ranks.append(rank)
    assert rank.client is not None
    long_key = os.urandom(8188) + (0).to_bytes(4, "big")  # 8 KiB
    with pytest.raises(InvalidRequest, match="key_bytes"):
        rank.client.store(1, [long_key], [0, 1])
    with pytest.raises(InvalidRequest, match="key_bytes"):
        rank.client.lookup([long_key], pin=True)
    assert rank.client.stats().entries == 0


def test_regions_jobs_sessions_and_registrations_are_bounded(
    daemon_factory: DaemonFactory, ranks: list[Rank]
) -> None:
    few = daemon_factory(
        limits=LimitsSettings(regions_per_session=2, sessions_per_uid=2, registrations_per_uid=2)
    )
    with pytest.raises(InvalidRequest, match="regions_per_session"):
        make_rank(few.endpoint, tp=1)  # three regions
    # Three engines: a second scheduler of one engine from this process would replace the
    # first, not add a session.
    configs = [make_config(tp=1, engine_id=f"engine-{i}") for i in range(3)]
    with (
        OffloadClient.connect(few.endpoint, configs[0], role="scheduler", heartbeat=0),
        OffloadClient.connect(few.endpoint, configs[1], role="scheduler", heartbeat=0),
        pytest.raises(InvalidRequest, match="sessions_per_uid"),
    ):
        OffloadClient.connect(few.endpoint, configs[2], role="scheduler", heartbeat=0)
    identity = uuid.uuid4().bytes
    for _ in range(2):
        register(few.endpoint, identity)  # tokens never used: they hold what they carry
    with pytest.raises(InvalidRequest, match="registrations_per_uid"):
        register(few.endpoint, identity)

    gated = FakeCopyEngine()
    busy = daemon_factory(copy_engine=gated, limits=LimitsSettings(jobs_per_session=1))
    rank = make_rank(busy.endpoint, tp=1)
    ranks.append(rank)
    assert rank.client is not None
    gated.gate.clear()
    rank.client.store(1, chain_keys(1, b"one"), [0, 1])
    with pytest.raises(InvalidRequest, match="jobs_per_session"):
        rank.client.store(2, chain_keys(1, b"two"), [2, 3])
    gated.gate.set()
    rank.client.wait([1], 10)
    _store(rank, chain_keys(1, b"two"), range(1, 2))


def test_a_departed_engines_metrics_labels_are_pruned(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    assert daemon.daemon is not None
    rank = make_rank(daemon.endpoint, tp=1, engine_id="come-and-go")
    _store(rank, chain_keys(1, b"labels"), range(1))

    def scraped() -> str:
        assert daemon.daemon is not None
        return generate_latest(daemon.daemon.metrics.registry).decode()

    assert 'engine="come-and-go"' in scraped()
    rank.close()  # Bye: the engine's last session ends
    assert 'engine="come-and-go"' not in scraped()


def test_a_raw_store_from_a_raw_registration_is_judged_like_any_other(
    daemon: DaemonThread,
) -> None:
    # A hand-made registration passing its own file works end to end: the client library
    # is a convenience, not a trust boundary.
    kv = SharedKVTensor.create(16, PAGE, ["layer.0"], prefix="od-test")
    peer = RawPeer(daemon.endpoint)
    fd = os.open(kv.path, os.O_RDWR)
    try:
        region = msgspec.structs.replace(kv.region, handle=ShmHandle(kv.path, 0, 16 * PAGE, 0))
        config = make_config(engine_id="raw", tp=1, bytes_per_block=PAGE)
        config = msgspec.structs.replace(
            config, groups=(msgspec.structs.replace(config.groups[0], layer_names=("layer.0",)),)
        )
        hello = Hello(1, PROTOCOL_VERSION, "worker", config, (region,), token=peer.token([fd]))
        assert isinstance(peer.ask(hello), Welcome)
        reply = peer.ask(Store(2, 1, chain_keys(1, b"raw"), [0, 1]))
        assert not isinstance(reply, Error), reply
    finally:
        os.close(fd)
        peer.close()
        kv.close()


# ---------------------------------------------------------------- round two (issue 22)


def _drop_to(user: User) -> str:
    # The interpreter may live where only root can read: start as root, then become ``user``
    # for good (as peer_process does) before anything the test examines happens.
    return f"import os; os.setgroups([]); os.setgid({user.gid}); os.setuid({user.uid}); "


def _python_as(user: User, code: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` as ``user`` (its primary group only)."""
    return subprocess.run(
        [sys.executable, "-c", _drop_to(user) + code],
        env={"PYTHONPATH": REPO, "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _plant(user: User, path: str, *, directory: bool = False, link_to: str = "") -> None:
    """``user`` makes ``path``: a 0666 file (or a 0777 directory, or a symlink)."""
    if link_to:
        code = f"import os; os.symlink({link_to!r}, {path!r})"
    elif directory:
        code = f"import os; os.mkdir({path!r}); os.chmod({path!r}, 0o777)"
    else:
        code = (
            f"import os; fd = os.open({path!r}, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666); "
            "os.fchmod(fd, 0o666); os.write(fd, b'planted')"
        )
    planted = _python_as(user, code)
    assert planted.returncode == 0, planted.stderr


def test_an_arena_another_user_placed_is_refused(users: dict[str, User], workdir: str) -> None:
    from offloadd.cache.arena import ArenaError

    attacker = users["odtrust-a"]
    tag = uuid.uuid4().hex[:12]
    victim_file = f"{workdir}/journal-like"
    with open(victim_file, "wb") as handle:
        handle.write(b"the daemon's bytes")
    squats = {
        "file": f"/dev/shm/od-test-squat-{tag}.arena",  # /dev/shm is sticky: the file check
        "symlink": f"/dev/shm/od-test-squat-{tag}.link",
        "directory": f"/dev/shm/od-test-squat-{tag}.dir",
    }
    try:
        _plant(attacker, squats["file"])
        _plant(attacker, squats["symlink"], link_to=victim_file)
        _plant(attacker, squats["directory"], directory=True)
        _plant(attacker, squats["directory"] + "/arena")
        for kind, path in squats.items():
            arena = path + "/arena" if kind == "directory" else path
            daemon = DaemonThread()
            daemon.settings = msgspec.structs.replace(
                daemon.settings, cache=msgspec.structs.replace(daemon.settings.cache, arena=arena)
            )
            try:
                with pytest.raises(ArenaError) as refused:
                    daemon.start()
            finally:
                daemon.stop()
            assert path in str(refused.value), kind
            assert f"uid {attacker.uid}" in str(refused.value), kind
        # Nothing of the daemon reached what the attacker placed or pointed at.
        with open(squats["file"], "rb") as handle:
            assert handle.read() == b"planted"
        with open(squats["directory"] + "/arena", "rb") as handle:
            assert handle.read() == b"planted"
        with open(victim_file, "rb") as handle:
            assert handle.read() == b"the daemon's bytes"
    finally:
        for path in squats.values():
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _serve_as(user: User, home: str, endpoint: str) -> subprocess.Popen[str]:
    """``offloadd serve`` as ``user`` with the default arena (and its state in ``home``)."""
    command = [
        sys.executable, "-m", "offloadd", "serve", "--endpoint", endpoint,
        "--capacity", "4MiB", "--no-persist", "--events-endpoint", "",
        "--metrics-address", "", "--log-level", "WARNING",
    ]  # fmt: skip
    code = (
        "import sys, offloadd.cli, offloadd.server.daemon, offloadd.server.metrics, "
        "offloadd.server.publisher, offloadd.cache.journal, pwd, grp; "
        + _drop_to(user)
        + f"sys.exit(offloadd.cli.main({command[3:]!r}))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": REPO, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home},
        cwd="/tmp",
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_default_arena_directory_is_the_daemons_own(users: dict[str, User]) -> None:
    attacker, owner = users["odtrust-a"], users["odtrust-b"]
    arena_dir = f"/dev/shm/offloadd-{owner.uid}"
    home = tempfile.mkdtemp(prefix="od-trust-home-", dir="/tmp")
    os.chown(home, owner.uid, owner.gid)
    endpoint = f"ipc://{home}/run/d.sock"
    shutil.rmtree(arena_dir, ignore_errors=True)
    try:
        # The attacker was first: a 0777 directory with a 0666 arena in it.
        _plant(attacker, arena_dir, directory=True)
        _plant(attacker, arena_dir + "/arena")
        served = _serve_as(owner, home, endpoint)
        _, err = served.communicate(timeout=60)
        assert served.returncode != 0
        refusal = [line for line in err.splitlines() if line.startswith("offloadd: ")]
        assert len(refusal) == 1, err
        assert arena_dir in refusal[0] and f"uid {attacker.uid}" in refusal[0], refusal
        with open(arena_dir + "/arena", "rb") as handle:
            assert handle.read() == b"planted"
        shutil.rmtree(arena_dir)

        # Not pre-created: the daemon makes it, 0700, and the attacker cannot read the arena.
        served = _serve_as(owner, home, endpoint)
        try:
            _until(lambda: os.path.exists(endpoint[len("ipc://") :]), "the daemon binding")
            info = os.lstat(arena_dir)
            assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (owner.uid, 0o700)
            arena = os.lstat(arena_dir + "/arena")
            assert (arena.st_uid, stat.S_IMODE(arena.st_mode)) == (owner.uid, 0o600)
            peek = _python_as(attacker, f"open({arena_dir + '/arena'!r}, 'rb').read(1)")
            assert "Permission denied" in peek.stderr
        finally:
            served.terminate()
            served.communicate(timeout=60)
    finally:
        shutil.rmtree(arena_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def test_a_disk_directory_others_own_or_can_write_is_refused(
    users: dict[str, User], workdir: str
) -> None:
    from offloadd.safety import UnsafePath

    attacker = users["odtrust-a"]
    theirs = f"{workdir}/theirs"
    os.mkdir(theirs, 0o700)
    os.chown(theirs, attacker.uid, attacker.gid)
    shared = f"{workdir}/shared"
    os.mkdir(shared)
    os.chmod(shared, 0o1777)  # like /tmp: anyone may add files
    linked = f"{workdir}/linked"
    os.symlink(shared, linked)
    for path, says in ((theirs, f"uid {attacker.uid}"), (shared, "writable"), (linked, "link")):
        daemon = DaemonThread(disk=DiskSettings(path=path))
        try:
            with pytest.raises(UnsafePath) as refused:
                daemon.start()
        finally:
            daemon.stop()
        assert path in str(refused.value) and says in str(refused.value), refused.value
    assert os.listdir(theirs) == []  # nothing of the daemon went there


def _disk_chunk(arena: Arena, key: bytes, data: bytes, offset: int = 0) -> ChunkAddress:
    arena.view(offset, len(data))[:] = data
    return ChunkAddress("victim-ns", key, ((offset, len(data)),))


def test_a_planted_temp_link_is_not_followed(workdir: str) -> None:
    arena = Arena(f"/dev/shm/od-test-trust-{uuid.uuid4().hex[:12]}.arena", 1 << 20)
    tier = DiskTier(f"{workdir}/disk", 1 << 20, direct_io=False, threads=1)
    try:
        arena.view(4 * PAGE, 6)[:] = b"arena!"
        data = os.urandom(2 * PAGE)
        chunk = _disk_chunk(arena, b"k" * 16, data)
        temp = f"{workdir}/disk/{chunkfile.file_name('victim-ns', chunk.key)}.tmp"
        # What an attacker with a way into the directory plants: a link to the daemon's arena.
        os.symlink(arena.path, temp)
        assert tier.put([chunk], arena).stored == [False]
        assert tier.stats().errors == 1
        assert os.stat(arena.path).st_size == 1 << 20  # not truncated
        assert bytes(arena.view(4 * PAGE, 6)) == b"arena!"
        assert os.path.islink(temp)  # not ours: left for whoever investigates
        os.unlink(temp)
        assert tier.put([chunk], arena).stored == [True]
        target = ChunkAddress("victim-ns", chunk.key, ((8 * PAGE, len(data)),))
        assert tier.get([target], arena) == [True]
        assert bytes(arena.view(8 * PAGE, len(data))) == data
    finally:
        tier.close()
        arena.close()


def test_a_chunk_file_of_another_user_is_not_served(users: dict[str, User], workdir: str) -> None:
    attacker = users["odtrust-a"]
    arena = Arena(f"/dev/shm/od-test-trust-{uuid.uuid4().hex[:12]}.arena", 1 << 20)
    tier = DiskTier(f"{workdir}/disk", 1 << 20, direct_io=False, threads=1)
    forged_dir = f"{workdir}/forged"
    try:
        data, forged = os.urandom(2 * PAGE), os.urandom(2 * PAGE)
        chunk = _disk_chunk(arena, b"v" * 16, data)
        assert tier.put([chunk], arena).stored == [True]
        # The attacker's file: the same name, a valid header and checksum, other bytes.
        with DiskTier(f"{workdir}/scratch", 1 << 20, direct_io=False, threads=1) as scratch:
            assert scratch.put([_disk_chunk(arena, chunk.key, forged, 4 * PAGE)], arena).stored
        relative = chunkfile.file_name("victim-ns", chunk.key)
        source = f"{workdir}/scratch/{relative}"
        os.chmod(workdir, 0o755)
        os.chmod(f"{workdir}/scratch", 0o755)
        os.chmod(os.path.dirname(source), 0o755)
        os.chmod(source, 0o644)
        os.mkdir(forged_dir, 0o700)
        os.chown(forged_dir, attacker.uid, attacker.gid)
        copy = f"open({forged_dir + '/f'!r}, 'wb').write(open({source!r}, 'rb').read())"
        copied = _python_as(attacker, copy)
        assert copied.returncode == 0, copied.stderr
        # Moved over the victim's file (as it would be in a directory others could write).
        os.rename(forged_dir + "/f", f"{workdir}/disk/{relative}")
        target = ChunkAddress("victim-ns", chunk.key, ((8 * PAGE, len(data)),))
        arena.view(8 * PAGE, len(data))[:] = bytes(len(data))
        assert tier.get([target], arena) == [False]
        assert tier.stats().errors == 1
        assert bytes(arena.view(8 * PAGE, len(data))) != forged
        assert tier.contains("victim-ns", [chunk.key]) == [False]
        # Nor after a restart: the scan drops it.
        assert not os.path.exists(f"{workdir}/disk/{relative}")  # deleted as a bad file
        copied = _python_as(attacker, copy)
        assert copied.returncode == 0, copied.stderr
        os.rename(forged_dir + "/f", f"{workdir}/disk/{relative}")
        with DiskTier(f"{workdir}/disk", 1 << 20, direct_io=False, threads=1) as reopened:
            assert reopened.contains("victim-ns", [chunk.key]) == [False]
    finally:
        tier.close()
        arena.close()


def test_descriptors_above_1023_do_not_stop_registrations(
    daemon: DaemonThread, ranks: list[Rank]
) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip("needs a descriptor limit of at least 4096")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    kv = SharedKVTensor.create(16, PAGE, ["layer.0"], prefix="od-test")
    fds = [os.open(kv.path, os.O_RDWR) for _ in range(1024)]
    try:
        # One registration as large as limits.regions_per_session allows: the daemon holds
        # its 1,024 descriptors, so the next registration's pidfd lies above 1023.
        register(daemon.endpoint, uuid.uuid4().bytes, fds)
        rank = make_rank(daemon.endpoint, tp=1, engine_id="after-many")
        ranks.append(rank)
        rank.fill(5)
        _store(rank, chain_keys(2, b"after-many"), range(2))
        assert rank.client is not None
        assert rank.client.lookup(chain_keys(2, b"after-many")).hits == 2
    finally:
        for fd in fds:
            os.close(fd)
        kv.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------- round two: bounds per tenant

_IDLE_ATTACK = """
import json, os, socket, sys, uuid
from offloadd.errors import OffloaddError
from offloadd.peer import register
from protocol.peer import decode_peer_reply, peer_socket_path
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
fd = os.memfd_create("od-attack")
os.ftruncate(fd, 4096)
out = {"registered": 0}
try:
    for _ in range(64):
        register(endpoint, uuid.uuid4().bytes, [fd] * 16)
        out["registered"] += 1
except OffloaddError as exc:
    out["refused"] = str(exc)
connections = []
for _ in range(200):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(peer_socket_path(endpoint))
    connections.append(sock)
connections[-1].settimeout(30)
out["last"] = decode_peer_reply(connections[-1].recv(65536)).message
print(json.dumps(out), flush=True)
sys.stdin.read()
"""


_ATTACK_ENV = {"PYTHONPATH": REPO, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def _attack_command(script: str, daemon: DaemonThread, user: User, group: int) -> list[str]:
    """``script`` run as ``user`` (it drops to that uid and ``group`` itself)."""
    return [sys.executable, "-c", script, daemon.endpoint, str(user.uid), str(user.gid), str(group)]


def _attack(script: str, daemon: DaemonThread, user: User, group: int) -> dict[str, Any]:
    """Run an attack script to its end; the JSON report on its last line."""
    attack = subprocess.run(
        _attack_command(script, daemon, user, group),
        env=_ATTACK_ENV, cwd="/tmp", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert attack.returncode == 0, attack.stderr
    report: dict[str, Any] = json.loads(attack.stdout.strip().splitlines()[-1])
    return report


def test_one_users_idle_registrations_never_block_another_user(
    users: dict[str, User],
    shared_daemon: Callable[..., DaemonThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Idle connections stay until the test ends (not CONNECTION_SECONDS): no race with time.
    monkeypatch.setattr("offloadd.server.peers.CONNECTION_SECONDS", 600.0)
    daemon = shared_daemon(limits=LimitsSettings(descriptors_per_uid=64))
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    attacker = subprocess.Popen(
        _attack_command(_IDLE_ATTACK, daemon, b, shared),
        env=_ATTACK_ENV,
        cwd="/tmp",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert attacker.stdout is not None and attacker.stderr is not None
        line = attacker.stdout.readline()
        assert line, attacker.stderr.read()
        report = json.loads(line)
        # Its waiting registrations hold descriptors up to limits.descriptors_per_uid only.
        assert report["registered"] == 3 and "descriptors_per_uid" in report["refused"], report
        # 200 idle connections of B are open or refused; at most 8 are kept.
        assert "connections_per_uid" in report["last"], report
        # A still registers, says Hello, stores and finds what it stored.
        victim = run_as(a, daemon.endpoint, "--engine", "victim", "--store", "mine")
        assert victim.get("connected") and victim["stored"] == 4, victim
        assert victim["uid"] == a.uid
    finally:
        attacker.communicate(timeout=60)


_BIG_HELLO = """
import json, os, sys, uuid
import zmq
from offloadd.peer import register
from protocol import PROTOCOL_VERSION
from protocol.messages import Hello, decode_reply, encode
from tests.integration.harness import make_config
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
identity = uuid.uuid4().bytes
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.ROUTING_ID, identity)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)
token = register(endpoint, identity, []).token
config = make_config(engine_id="big", tp=1, extra={"pad": ["x" * 64] * (1 << 15)})
frame = encode(Hello(7, PROTOCOL_VERSION, "scheduler", config, token=token))
sock.send(frame)
assert sock.poll(30_000), "no answer"
reply = decode_reply(sock.recv())
print(json.dumps({"bytes": len(frame), "id": reply.request_id, "code": reply.code}))
"""


def test_an_oversize_hello_is_refused_before_it_is_decoded(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    daemon = shared_daemon()
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    with held_as(a, daemon.endpoint, "--engine", "victim", "--store", "mine") as held:
        assert held["stored"] == 4, held
        report = _attack(_BIG_HELLO, daemon, b, shared)
        limit = LimitsSettings().hello_bytes
        assert report["bytes"] > limit, report
        assert report["code"] == ErrorCode.TOO_LARGE and report["id"] == 7, report
        # The victim's cache answers: what A stored is found by another engine of A.
        seen = run_as(a, daemon.endpoint, "--engine", "victim-2", "--lookup", "mine")
        assert seen["hits"] == 4, seen
    assert _admin_stats(daemon.endpoint).count("big") == 0


_SPARSE_HELLO = """
import fcntl, json, os, sys, uuid
import zmq
from offloadd.peer import register
from protocol import PROTOCOL_VERSION
from protocol.handles import KVRegion, ShmHandle
from protocol.messages import Hello, decode_reply, encode
from tests.integration.harness import LAYERS, make_config
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
fd = os.memfd_create("od-sparse", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 1 << 40)  # sparse: 1 TiB of address space for 2 pages of regions
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
identity = uuid.uuid4().bytes
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.ROUTING_ID, identity)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)
token = register(endpoint, identity, [fd]).token
regions = tuple(
    KVRegion(ShmHandle("sparse", i * 4096, 4096, fd=0), 1, 4096, 4096, (name,))
    for i, name in enumerate(LAYERS)
)
config = make_config(engine_id="sparse", tp=1, bytes_per_block=4096 * len(LAYERS))
sock.send(encode(Hello(9, PROTOCOL_VERSION, "worker", config, regions, token=token)))
assert sock.poll(30_000), "no answer"
reply = decode_reply(sock.recv())
print(json.dumps({"code": getattr(reply, "code", None), "message": getattr(reply, "message", "")}))
"""


def test_a_sparse_region_file_far_larger_than_its_regions_is_refused(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    daemon = shared_daemon()
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    report = _attack(_SPARSE_HELLO, daemon, b, shared)
    assert report["code"] == ErrorCode.TOO_LARGE, report
    assert "furthest region's end" in report["message"], report
    victim = run_as(a, daemon.endpoint, "--engine", "victim", "--store", "mine")
    assert victim.get("connected") and victim["stored"] == 4, victim


def test_an_engine_id_stays_its_users_across_a_restart(
    users: dict[str, User], shared_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOADD_SERVER__SOCKET_GROUP", SHARED_GROUP)
    arena = f"/dev/shm/od-trust-owners-{uuid.uuid4().hex[:12]}.arena"
    serve = ServeProcess(shared_dir, arena)
    a, b = users["odtrust-a"], users["odtrust-b"]
    try:
        serve.start()
        first = run_as(a, serve.endpoint, "--engine", "victim", "--store", "mine")
        assert first["stored"] == 4, first
        serve.stop()
        owners = serve.journal + ".engines"
        assert stat.S_IMODE(os.stat(owners).st_mode) == 0o600
        serve.start()
        # B read "victim" from the metrics and says Hello first after the restart.
        taken = run_as(b, serve.endpoint, "--engine", "victim")
        assert "belongs to another user" in str(taken["error"]), taken
        again = run_as(a, serve.endpoint, "--engine", "victim", "--store", "mine")
        assert again.get("connected") and again["stored"] == 4, again
    finally:
        if serve.process is not None:
            serve.stop()
        serve.cleanup()


# ---------------------------------------------------------------- round two: who sees what


@pytest.fixture
def exposed_daemon(shared_dir: str) -> Iterator[DaemonThread]:
    """A daemon (as root) whose sockets SHARED_GROUP may use, with its KV events and metrics
    at their defaults: beside the control socket, in the 0750 directory only that group
    enters."""
    daemon = DaemonThread(endpoint=f"ipc://{shared_dir}/d.sock", socket_group=SHARED_GROUP)
    daemon.settings = msgspec.structs.replace(
        daemon.settings,
        events=msgspec.structs.replace(EventSettings(), pod="test-pod"),
        metrics=MetricsSettings(),
    )
    daemon.start()
    yield daemon
    daemon.stop()


_PEEK = """
import json, os, socket, sys, uuid
import zmq
from offloadd.peer import register
from protocol.messages import GetStats, decode_reply, encode
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
path = endpoint[len("ipc://"):]
out = {}
for name in ("events", "replay", "metrics"):
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(f"{path}.{name}")
        out[name] = "connected"
    except OSError as exc:
        out[name] = exc.strerror
    probe.close()
if out["events"] == "connected":
    identity = uuid.uuid4().bytes
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    registered = register(endpoint, identity, []).token
    for label, token in (("sessionless", b""), ("registered", registered)):
        sock.send(encode(GetStats(len(out), token)))
        assert sock.poll(30_000), "no answer"
        stats = decode_reply(sock.recv()).stats
        out[label] = {
            "engines": [e.engine_id for e in stats.engines], "counters": stats.counters,
            "sessions": stats.sessions, "lookups": stats.lookups, "used": stats.used_bytes,
            "stored": stats.bytes_stored, "version": stats.version,
            "capacity": stats.capacity_bytes, "events": stats.events_endpoint,
        }
print(json.dumps(out))
"""


def test_who_reads_the_events_the_metrics_and_the_stats(
    users: dict[str, User], exposed_daemon: DaemonThread
) -> None:
    daemon = exposed_daemon
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    control = daemon.endpoint[len("ipc://") :]
    with held_as(a, daemon.endpoint, "--engine", "victim", "--store", "mine") as held:
        assert held["stored"] == 4, held
        seen = _attack(_PEEK, daemon, b, shared)
        # A group member may subscribe to the events (routers do) but not read the metrics,
        # which name every tenant's engines and count their bytes.
        assert seen["events"] == seen["replay"] == "connected", seen
        assert seen["metrics"] == "Permission denied", seen
        # GetStats, with or without a registration: B's own engines (none) and nothing a
        # tenant did; what is no tenant's stays (a rank needs the capacity and the events).
        for label in ("sessionless", "registered"):
            view = seen[label]
            assert view["engines"] == [] and view["counters"] is False, view
            assert view["sessions"] == view["lookups"] == view["used"] == view["stored"] == 0
            assert view["version"] and view["capacity"] == daemon.settings.cache.capacity
            assert view["events"] == f"ipc://{control}.events"
        # Outside the group (nobody): not even the directory opens.
        entry = pwd.getpwnam("nobody")
        nobody = User("nobody", entry.pw_uid, entry.pw_gid)
        outside = _attack(_PEEK, daemon, nobody, entry.pw_gid)
        assert {outside[name] for name in ("events", "replay", "metrics")} == {
            "Permission denied"
        }, outside
        # Root (an admin) sees A's engine and every counter; the daemon's user reads metrics.
        with OffloadClient(daemon.endpoint, heartbeat=0) as admin:
            stats = admin.stats()
        assert [e.engine_id for e in stats.engines] == ["victim"] and stats.counters
        assert stats.bytes_stored > 0 and stats.sessions == 1
        assert stat.S_IMODE(os.stat(control + ".metrics").st_mode) == 0o600


_CACHE_CLI = """
import os, sys
import offloadd.client, offloadd.errors  # what the command imports when it runs
from offloadd.cli import build_parser, main
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
build_parser().parse_args(["cache", *sys.argv[5:]])  # argparse's own lazy imports
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
sys.exit(main(["cache", *sys.argv[5:], "--endpoint", endpoint]))
"""


def test_a_group_member_may_not_list_or_clear_the_cache(
    users: dict[str, User], exposed_daemon: DaemonThread
) -> None:
    daemon = exposed_daemon
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    with held_as(a, daemon.endpoint, "--engine", "victim", "--store", "mine") as held:
        assert held["stored"] == 4, held
        for argv in (["ls"], ["clear", "--all"], ["clear", "--engine", "victim"]):
            command = [*_attack_command(_CACHE_CLI, daemon, b, shared), *argv]
            done = subprocess.run(
                command, env=_ATTACK_ENV, cwd="/tmp", capture_output=True, text=True,
                timeout=120, check=False,
            )  # fmt: skip
            assert done.returncode == 1, (argv, done.stdout, done.stderr)
            assert "only root and the daemon's user (uid 0)" in done.stderr, done.stderr
            assert f"you are uid {b.uid}" in done.stderr and "victim" not in done.stdout
        # Nothing was dropped: root (an admin) still lists A's four chunks.
        with OffloadClient(daemon.endpoint, heartbeat=0) as admin:
            listing = admin.list_cache()
        assert [n.chunks for n in listing.namespaces] == [4]
        assert [(e.engine_id, e.connected) for e in listing.engines] == [("victim", True)]


_TOPICS = """
import json, os, sys
from offloadd.client import OffloadClient
from offloadd.errors import NotPermitted
from tests.integration.harness import make_config, make_rank
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
other = os.environ["OD_OTHER_TOPIC"]
out = {}
config = make_config(engine_id=f"e{uid}", tp=1, events=True)
try:
    OffloadClient.connect(endpoint, config, role="scheduler", events_topic=other, heartbeat=0)
    out["other_topic"] = "accepted"
except NotPermitted as exc:
    out["other_topic"] = str(exc)
rank = make_rank(endpoint, tp=1, engine_id=f"e{uid}", events=True)
try:
    out["cleared"] = rank.client.clear()
finally:
    rank.close()
print(json.dumps(out))
"""


def _replayed_topics(replay: str) -> list[tuple[str, list[str]]]:
    """Every batch the replay socket holds: its topic and its events' types."""
    from protocol.events import END_SEQ, decode_batch

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(replay)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[tuple[str, list[str]]] = []
        while True:
            assert sock.poll(10_000), "no end of the replay"
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return batches
            kinds = [type(event).__name__ for event in decode_batch(payload).events]
            batches.append((topic.decode(), kinds))
    finally:
        sock.close(linger=0)
        ctx.term()


def test_each_tenants_events_carry_its_own_topic(
    users: dict[str, User], exposed_daemon: DaemonThread
) -> None:
    daemon = exposed_daemon
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    topic = {user.uid: f"kv@test-pod/u{user.uid}@test/model" for user in (a, b)}
    for user, other in ((a, b), (b, a)):
        env = {**_ATTACK_ENV, "OD_OTHER_TOPIC": topic[other.uid]}
        attack = subprocess.run(
            _attack_command(_TOPICS, daemon, user, shared),
            env=env, cwd="/tmp", capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert attack.returncode == 0, attack.stderr
        report = json.loads(attack.stdout.strip().splitlines()[-1])
        # Naming the other tenant's topic is refused; its own engine clears as usual.
        assert "its own topics" in report["other_topic"], report
        assert report["cleared"] == 0, report
    assert daemon.daemon is not None
    replay = daemon.daemon.settings.events.replay_endpoint  # "auto", placed beside d.sock
    assert replay == daemon.endpoint + ".replay"
    batches = _replayed_topics(replay)
    assert batches == [
        (topic[a.uid], ["AllBlocksCleared"]),
        (topic[b.uid], ["AllBlocksCleared"]),
    ], batches


# Finding 4, pins and reservations: chunks of 2 blocks of 3 layers of a page (24 KiB), files
# of 16 blocks (8 chunks) per rank, as peer_process makes them.
_RANK_FILES = """
import json, os, sys, uuid
from offloadd.client import OffloadClient
from protocol.handles import KVRegion, ShmHandle
from tests.integration.configs import LAYERS, chain_keys, chunk_block_ids, make_config
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
PAGE, BLOCKS = 4096, 16
CHUNKS = range(BLOCKS // 2)

def files():
    fds, regions = [], []
    for layer in LAYERS:
        path = f"/dev/shm/od-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        os.ftruncate(fd, BLOCKS * PAGE)
        fds.append(fd)
        regions.append(KVRegion(ShmHandle(f"/proc/self/fd/{fd}", 0, BLOCKS * PAGE, fd=len(fds) - 1),
                                BLOCKS, PAGE, PAGE, (layer,)))
    return fds, regions

def connect(engine, role="worker"):
    config = make_config(engine_id=engine, tp=1, bytes_per_block=PAGE * len(LAYERS))
    fds, regions = files() if role == "worker" else ([], [])
    client = OffloadClient.connect(endpoint, config, regions if role == "worker" else (),
                                   role=role, heartbeat=0)
    client.wait_ready(10)
    return client, fds

def store(client, keys, job):
    for at in range(0, len(keys), len(CHUNKS)):
        batch = keys[at:at + len(CHUNKS)]
        client.store(job + at, batch, chunk_block_ids(range(len(batch)), 2))
        client.wait([job + at], 10)
"""

_GREEDY_TENANT = (
    _RANK_FILES
    + """
w1, _ = connect("greedy-1")
s1, _ = connect("greedy-1", "scheduler")
w2, _ = connect("greedy-2")
s2, _ = connect("greedy-2", "scheduler")
mine = chain_keys(48, b"greedy")
store(w1, mine, 100)
out = {"stored": w1.lookup(mine).hits}
# Reservations that are never stored, pins with the longest lease, from two engines.
out["reserved_1"] = len(s1.reserve(chain_keys(8, b"never-1")).reserved)
out["pinned_1"] = w1.lookup(mine, pin=True, lease=1e9).pinned
out["reserved_2"] = len(s2.reserve(chain_keys(96, b"never-2")).reserved)
out["pinned_2"] = w2.lookup(mine, pin=True, lease=1e9).pinned
print(json.dumps(out), flush=True)
sys.stdin.read()
"""
)

_PATIENT_TENANT = (
    _RANK_FILES
    + """
rank, fds = connect("patient")
keys = chain_keys(24, b"patient")
written = {}
for at in range(0, 24, 8):  # each round's chunks get bytes of their own
    for fd in fds:
        os.pwrite(fd, os.urandom(BLOCKS * PAGE), 0)
    for i in CHUNKS:
        written[keys[at + i]] = [os.pread(fd, 2 * PAGE, 2 * PAGE * i) for fd in fds]
    store(rank, keys[at:at + 8], 10 + at)
print(json.dumps({"stored": rank.lookup(keys).hits}), flush=True)
sys.stdin.readline()  # the other user attacks meanwhile
out = {"hits": rank.lookup(keys).hits, "wrong": 0}
for at in range(0, out["hits"] - out["hits"] % 8, 8):
    for fd in fds:
        os.pwrite(fd, bytes(BLOCKS * PAGE), 0)
    rank.load(50 + at, keys[at:at + 8], chunk_block_ids(CHUNKS, 2))
    rank.wait([50 + at], 10)
    for i in CHUNKS:
        got = [os.pread(fd, 2 * PAGE, 2 * PAGE * i) for fd in fds]
        out["wrong"] += got != written[keys[at + i]]
fresh = chain_keys(24, b"patient-later")
store(rank, fresh, 200)
out["stored"] = rank.lookup(fresh).hits
print(json.dumps(out), flush=True)
"""
)


def test_one_users_engines_cannot_pin_and_reserve_another_user_out(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    chunk = 2 * PAGE * 3
    # protected_fraction and tenant_protected_fraction by default: 48 of the 96 chunks per
    # engine, and per user; a reservation lasts limits.reservation_seconds.
    daemon = shared_daemon(capacity=96 * chunk, limits=LimitsSettings(reservation_seconds=3.0))
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid

    def start(script: str, user: User) -> subprocess.Popen[str]:
        return subprocess.Popen(
            _attack_command(script, daemon, user, shared),
            env=_ATTACK_ENV, cwd="/tmp", text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    def report(process: subprocess.Popen[str]) -> dict[str, Any]:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline()
        assert line, process.stderr.read()
        found: dict[str, Any] = json.loads(line)
        return found

    victim, attacker = start(_PATIENT_TENANT, a), None
    try:
        assert report(victim) == {"stored": 24}
        attacker = start(_GREEDY_TENANT, b)
        greedy = report(attacker)
        # Its first engine reserved 8 and pinned 40: the user's share; its second engine got
        # nothing (it had 48 chunks of its own engine budget: the victim's 24 were evicted
        # for its reservations and every later store was refused, before).
        assert greedy == {
            "stored": 48, "reserved_1": 8, "pinned_1": 40, "reserved_2": 0, "pinned_2": 0
        }, greedy  # fmt: skip
        assert victim.stdin is not None
        victim.stdin.write("go\n")
        victim.stdin.flush()
        after = report(victim)
        # The victim's hits, loads (every byte its own) and stores all still work.
        assert after == {"hits": 24, "wrong": 0, "stored": 24}, after
        with OffloadClient(daemon.endpoint, heartbeat=0) as admin:
            assert admin.stats().stores_refused_by_reason.get("tenant") == 96
            # The 8 reservations never stored are dropped when their lease ends.
            _until(lambda: admin.stats().stores_refused_by_reason.get("expired") == 8, "expiry")
            assert admin.stats().stores_refused_by_reason.get("full", 0) == 0
    finally:
        victim.kill()
        victim.communicate(timeout=60)
        if attacker is not None:
            attacker.communicate(timeout=60)


def test_the_bytes_one_users_sessions_map_are_bounded(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    rank_files = 3 * 16 * PAGE  # what one peer_process rank maps: three files of 16 pages
    daemon = shared_daemon(limits=LimitsSettings(mapped_bytes_per_uid=2 * rank_files + PAGE))
    a, b = users["odtrust-a"], users["odtrust-b"]
    endpoint = daemon.endpoint
    with (
        held_as(b, endpoint, "--engine", "map-1") as first,
        held_as(b, endpoint, "--engine", "map-2") as second,
    ):
        assert first.get("connected") and second.get("connected"), (first, second)
        third = run_as(b, endpoint, "--engine", "map-3")
        assert "limits.mapped_bytes_per_uid" in str(third["error"]), third
        # Another user's sessions are not counted against it.
        victim = run_as(a, endpoint, "--engine", "victim", "--store", "mine")
        assert victim.get("connected") and victim["stored"] == 4, victim
    # Sessions that ended map nothing any more.
    again = run_as(b, endpoint, "--engine", "map-3", "--store", "again")
    assert again.get("connected") and again["stored"] == 4, again


# ---------------------------------------------------------------- issue 46: bounded work

_OVERSIZED_STEPS = """
import fcntl, json, os, sys, uuid
import msgspec
import zmq
from offloadd.peer import register
from protocol import PROTOCOL_VERSION
from protocol.handles import CanonicalPage, KVRegion, ShmHandle
from protocol.messages import Hello, Lookup, Ping, Reserve, StepJobs, Store, decode_reply, encode
from tests.integration.harness import LAYERS, make_config
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
identity = uuid.uuid4().bytes
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.ROUTING_ID, identity)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)

def replies_until_ping(request, ping_id):
    # Every reply the request caused, counted up to the Ping sent after it.
    sock.send(encode(request))
    sock.send(encode(Ping(ping_id)))
    got = []
    while True:
        assert sock.poll(60_000), "no answer"
        reply = decode_reply(sock.recv())
        rid = getattr(reply, "request_id", None)
        if rid == ping_id:
            return got
        got.append((rid, getattr(reply, "code", None), getattr(reply, "message", "")))

out = {}
# No session: a step message of 5,000 nested lookups, then a StepJobs of 5,000 jobs.
lookups = [Lookup(100 + i, []) for i in range(5000)]
out["lookups"] = replies_until_ping(Reserve(5, [], lookups=lookups), 6)
jobs = [Store(0, i, [], []) for i in range(5000)]
out["jobs"] = replies_until_ping(StepJobs(7, jobs), 8)
# A canonical Hello whose page of 1 MiB is copied in 1-byte fragments.
page = 1 << 20
fd = os.memfd_create("od-fragments", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, page)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
token = register(endpoint, identity, [fd]).token
canonical = CanonicalPage(page, ((0, 0, 1, page, 1, 1),))
region = KVRegion(ShmHandle("frag", 0, page, fd=0), 1, page, page, LAYERS, canonical)
config = msgspec.structs.replace(
    make_config(engine_id="fragments", tp=1, bytes_per_block=page), canonical_layout=True
)
out["hello"] = replies_until_ping(
    Hello(9, PROTOCOL_VERSION, "worker", config, (region,), token=token), 10
)
print(json.dumps(out))
"""


def test_oversized_step_messages_and_canonical_pages_are_refused_before_their_work(
    users: dict[str, User], shared_daemon: Callable[..., DaemonThread]
) -> None:
    daemon = shared_daemon()
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    limits = LimitsSettings()
    with held_as(a, daemon.endpoint, "--engine", "victim", "--store", "mine") as held:
        assert held["stored"] == 4, held
        report = _attack(_OVERSIZED_STEPS, daemon, b, shared)
        # One answer each, TOO_LARGE, naming the bound; none of the 5,000 lookups or jobs was
        # handled (each would have been answered NOT_REGISTERED, one by one).
        [(rid, code, message)] = report["lookups"]
        assert (rid, code) == (5, ErrorCode.TOO_LARGE), report["lookups"]
        assert f"limits.lookups_per_message = {limits.lookups_per_message}" in message
        [(rid, code, message)] = report["jobs"]
        assert (rid, code) == (7, ErrorCode.TOO_LARGE), report["jobs"]
        assert f"limits.jobs_per_message = {limits.jobs_per_message}" in message
        [(rid, code, message)] = report["hello"]
        assert (rid, code) == (9, ErrorCode.TOO_LARGE), report["hello"]
        assert "limits.fragments_per_page" in message
        # The victim is served: what A stored is found by another engine of A.
        seen = run_as(a, daemon.endpoint, "--engine", "victim-2", "--lookup", "mine")
        assert seen["hits"] == 4, seen
    assert "fragments" not in _admin_stats(daemon.endpoint)


_IDLE_CONNECTIONS = """
import encodings.idna, json, os, select, socket, sys, time
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
metrics, expected = sys.argv[5], json.loads(sys.argv[6])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
path = endpoint[len("ipc://"):]
opened = {}
for name, target in (("control", path), ("events", path + ".events")):
    opened[name] = []
    for _ in range(20):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(target)
        opened[name].append(sock)
host, port = metrics.rsplit(":", 1)
opened["metrics"] = [socket.create_connection((host, int(port))) for _ in range(12)]
closed = {name: 0 for name in opened}
alive = {sock: name for name, socks in opened.items() for sock in socks}
deadline = time.monotonic() + 8
while closed != expected and time.monotonic() < deadline:
    ready, _, _ = select.select(list(alive), [], [], 0.1)
    for sock in ready:
        try:
            data = sock.recv(4096)  # libzmq's greeting, then the end of a refused one
        except ConnectionResetError:
            data = b""
        if not data:
            closed[alive.pop(sock)] += 1
print(json.dumps(closed), flush=True)
sys.stdin.read()
"""


def test_idle_connections_beyond_the_bounds_are_closed_and_the_victim_is_served(
    users: dict[str, User], shared_dir: str
) -> None:
    limits = LimitsSettings(
        socket_connections=16, socket_connections_per_uid=6, metrics_connections=4
    )
    daemon = DaemonThread(
        endpoint=f"ipc://{shared_dir}/d.sock", socket_group=SHARED_GROUP, limits=limits
    )
    daemon.settings = msgspec.structs.replace(
        daemon.settings,
        events=msgspec.structs.replace(EventSettings(), pod="test-pod"),
        metrics=MetricsSettings(address="127.0.0.1:0"),
    )
    daemon.start()
    try:
        assert daemon.daemon is not None
        metrics = daemon.daemon.metrics.address
        a, b = users["odtrust-a"], users["odtrust-b"]
        shared = grp.getgrnam(SHARED_GROUP).gr_gid
        # Of B's 20 idle connections to each ZeroMQ socket, 6 are kept (its uid's bound);
        # of its 12 to the metrics, 4 (served at once, all peers together).
        expected = {"control": 14, "events": 14, "metrics": 8}
        command = _attack_command(_IDLE_CONNECTIONS, daemon, b, shared)
        attacker = subprocess.Popen(
            [*command, metrics, json.dumps(expected)],
            env=_ATTACK_ENV, cwd="/tmp", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert attacker.stdout is not None and attacker.stderr is not None
            line = attacker.stdout.readline()
            assert line, attacker.stderr.read()
            assert json.loads(line) == expected
            # While B holds its connections, A connects, stores and finds what it stored.
            victim = run_as(a, daemon.endpoint, "--engine", "victim", "--store", "mine")
            assert victim.get("connected") and victim["stored"] == 4, victim
            seen = run_as(a, daemon.endpoint, "--engine", "victim-2", "--lookup", "mine")
            assert seen["hits"] == 4, seen
        finally:
            attacker.communicate(timeout=60)
    finally:
        daemon.stop()


# ---------------------------------------------------------------- round three: fairness

_SCHEDULERS = """
import json, os, select, sys, time, uuid
import zmq
from offloadd.peer import register
from protocol import PROTOCOL_VERSION
from protocol.messages import GetStats, Hello, Lookup, Welcome, decode_reply, encode
from tests.integration.configs import chain_keys, make_config
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
name, sessions, count = sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
ctx = zmq.Context()
socks = []
for index in range(sessions):
    identity = uuid.uuid4().bytes
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    socks.append(sock)
    if name == "sessionless":  # no registration, no Hello: the daemon knows nothing of it
        continue
    token = register(endpoint, identity, []).token
    config = make_config(engine_id=f"{name}-{index}", tp=1)
    sock.send(encode(Hello(1, PROTOCOL_VERSION, "scheduler", config, token=token)))
    assert sock.poll(30_000), "no Welcome"
    assert isinstance(decode_reply(sock.recv()), Welcome)
keys = chain_keys(64, name.encode())
print(json.dumps({"identities": [s.getsockopt(zmq.ROUTING_ID).hex() for s in socks]}), flush=True)
def request(rid):
    return encode(Lookup(rid, keys) if rid % 2 else GetStats(rid))
if count:  # one request at a time, each answered before the next
    [sock] = socks
    for rid in range(2, 2 + count):
        sock.send(request(rid))
        while True:
            assert sock.poll(30_000), "no answer"
            if decode_reply(sock.recv()).request_id == rid:
                break
    print(json.dumps({"served": count}), flush=True)
    sys.stdin.read()
else:  # as fast as the daemon reads, replies unread, until stdin speaks
    rid, deadline = 2, time.monotonic() + 90
    while not select.select([sys.stdin], [], [], 0)[0] and time.monotonic() < deadline:
        for sock in socks:
            try:
                for _ in range(64):
                    sock.send(request(rid), zmq.NOBLOCK)
                    rid += 1
            except zmq.Again:
                time.sleep(0.001)
    print(json.dumps({"sent": rid - 2}), flush=True)
"""


@pytest.mark.parametrize("flood", ["sessions", "sessionless"])
def test_a_tenants_flood_delays_another_tenant_by_one_item_per_turn(
    flood: str,
    users: dict[str, User],
    shared_daemon: Callable[..., DaemonThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Which requests the daemon's loop queued and ran, in order (its lanes, traced): a count
    # of the items run between a victim's request being read and being run, not a timing.
    trace: list[tuple[str, bytes, bool]] = []

    class Traced(offloadd.server.lanes.Lanes):
        def add(self, peer: bytes, frames: list[bytes], urgent: bool) -> None:
            super().add(peer, frames, urgent)
            trace.append(("add", peer, urgent))

        def pop(self) -> tuple[offloadd.server.lanes.Item, bool] | None:
            popped = super().pop()
            if popped is not None and isinstance(popped[0], tuple):
                trace.append(("run", popped[0][0], popped[1]))
            return popped

    monkeypatch.setattr("offloadd.server.control.Lanes", Traced)
    daemon = shared_daemon()
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid

    def start(user: User, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*_attack_command(_SCHEDULERS, daemon, user, shared), *args],
            env=_ATTACK_ENV, cwd="/tmp", text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    def report(process: subprocess.Popen[str]) -> dict[str, Any]:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline()
        assert line, process.stderr.read()
        found: dict[str, Any] = json.loads(line)
        return found

    # B floods Lookups (control lane) and GetStats (bulk lane) from 4 sessions, or from 4
    # sockets with neither a registration nor a session; A says Hello (registered: its
    # tenant's turn, not the sessionless peers') and asks 60 of the same, one at a time.
    attacker = start(b, "flood" if flood == "sessions" else "sessionless", "4", "0")
    victim = None
    try:
        flooders = {bytes.fromhex(identity) for identity in report(attacker)["identities"]}
        victim = start(a, "victim", "1", "60")
        [mine] = [bytes.fromhex(identity) for identity in report(victim)["identities"]]
        assert report(victim) == {"served": 60}
    finally:
        for process in (victim, attacker):
            if process is not None:
                process.communicate("stop\n", timeout=60)
    events = list(trace)
    judged, queued = 0, 0
    for index, (kind, peer, _urgent) in enumerate(events):
        if peer in flooders:
            queued += 1 if kind == "add" else -1
        if kind != "add" or peer != mine or queued < 32:
            continue  # A's requests read while B had a backlog queued in the lanes
        judged += 1
        end = next(i for i in range(index + 1, len(events)) if events[i][:2] == ("run", mine))
        lane = events[end][2]
        ahead = [event for event in events[index + 1 : end] if event[1] in flooders]
        ran = [event for event in ahead if event[0] == "run"]
        # Of its lane, at most one of B's items (B's turn when A's request came); of the other
        # lane, at most the one bulk item a control burst lets through, or the control burst
        # (_BATCH) each of the two bulk turns may be given.
        assert len([e for e in ran if e[2] == lane]) <= 1, (lane, len(ran))
        assert len(ran) <= (2 * 32 + 1 if lane else 2), (lane, len(ran))
    assert judged >= 40, f"only {judged} of A's requests met a backlog of B's"


_PARKING_FLOOD = (
    _RANK_FILES
    + """
from offloadd.errors import JobError
# Four engines of this user, each rank sending 1,024 one-chunk stores that name a Reserve its
# scheduler never sends: each waits for it, in the daemon's waiting-stores queue.
out = {"sent": 0}
for engine in range(4):
    worker, _ = connect(f"parking-{engine}")
    scheduler, _ = connect(f"parking-{engine}", "scheduler")
    named = (scheduler.welcome.session_id, 1 << 30)
    for job in range(1, 1025):
        worker.store(job, chain_keys(1, b"p%d-%d" % (engine, job)), chunk_block_ids([0], 2),
                     reserved=True, reserve=named)
        out["sent"] += 1
    try:
        done = worker.wait(range(1, 1025), 0.5, raise_on_failure=False)
    except JobError as exc:  # those waiting did not finish: the others did
        done = exc.results
    out[f"ok_{engine}"] = sum(d.ok for d in done)
    out[f"not_stored_{engine}"] = sum(not d.ok and len(d.failed_keys) == 1 for d in done)
print(json.dumps(out), flush=True)
sys.stdin.read()
"""
)

_STORE_BEFORE_RESERVE = (
    _RANK_FILES
    + """
worker, fds = connect("early")
scheduler, _ = connect("early", "scheduler")
keys = chain_keys(8, b"early")
reserve = scheduler._core.reserve(keys, [], [], 0, [])  # numbered, sent after the stores
named = (scheduler.welcome.session_id, reserve.request_id)
for i, key in enumerate(keys):
    worker.store(i + 1, [key], chunk_block_ids([i], 2), reserved=True, reserve=named)
scheduler._post_awaited(reserve)
done = worker.wait(range(1, 9), 10, raise_on_failure=False)
print(json.dumps({"ok": sum(d.ok for d in done), "bytes": sum(d.nbytes for d in done),
                  "hits": worker.lookup(keys).hits}), flush=True)
"""
)


def test_a_tenant_filling_the_waiting_stores_never_drops_anothers(
    users: dict[str, User], shared_dir: str
) -> None:
    daemon = DaemonThread(endpoint=f"ipc://{shared_dir}/d.sock", socket_group=SHARED_GROUP)
    # A parked store waits 1.5 x mirror_ack_timeout: longer than the test.
    daemon.settings = msgspec.structs.replace(
        daemon.settings,
        server=msgspec.structs.replace(daemon.settings.server, mirror_ack_timeout=60.0),
    )
    daemon.start()
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    limits = LimitsSettings()
    attacker = subprocess.Popen(
        _attack_command(_PARKING_FLOOD, daemon, b, shared),
        env=_ATTACK_ENV, cwd="/tmp", text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert attacker.stdout is not None and attacker.stderr is not None
        line = attacker.stdout.readline()
        assert line, attacker.stderr.read()
        flood = json.loads(line)
        # 4,096 stores sent, the whole queue's worth: its tenant's share waits, and every one
        # beyond it is answered not stored (none ok, its one key failed).
        assert flood["sent"] == 4096, flood
        share = limits.waiting_stores_per_tenant
        assert sum(flood[f"ok_{e}"] for e in range(4)) == 0, flood
        assert sum(flood[f"not_stored_{e}"] for e in range(4)) == 4096 - share, flood
        with OffloadClient(daemon.endpoint, heartbeat=0) as admin:
            stats = admin.stats()
            assert stats.stores_waiting == share
            assert stats.stores_refused_by_reason.get("waiting") == 4096 - share
        # A's stores read before their scheduler's Reserve wait for it and are all stored.
        victim = _attack(_STORE_BEFORE_RESERVE, daemon, a, shared)
        assert victim == {"ok": 8, "bytes": 8 * 2 * PAGE * 3, "hits": 8}, victim
        with OffloadClient(daemon.endpoint, heartbeat=0) as admin:
            assert admin.stats().stores_waiting == share  # B's still wait (for 90 s)
    finally:
        attacker.communicate("", timeout=60)
        daemon.stop()


# ---------------------------------------------------------------- round three: memory, turns


def _serve_in_shared_dir(shared_dir: str, log_level: str = "WARNING", **env: str) -> ServeProcess:
    """``offloadd serve`` (root) in its own process, its sockets for SHARED_GROUP; events,
    replay and metrics beside the control socket; its log in ``log_path``; ``env`` added to
    its environment."""
    config = os.path.join(shared_dir, "offloadd.toml")
    with open(config, "w") as handle:
        handle.write(f'[server]\nsocket_group = "{SHARED_GROUP}"\n')
    serve = ServeProcess(
        shared_dir, f"/dev/shm/od-test-{uuid.uuid4().hex[:12]}.arena", persist=False,
        config=config, beside=True, log_level=log_level,
    )  # fmt: skip
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return serve.start(log=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


_BIG_FRAMES = """
import json, os, socket, struct, sys
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
count, size = int(sys.argv[5]), int(sys.argv[6])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
# A raw ZeroMQ peer (ZMTP 3.0, NULL, as a DEALER): no registration, no Hello, only frames.
greeting = b"\\xff" + bytes(8) + b"\\x7f\\x03\\x00" + b"NULL".ljust(20, b"\\0") + bytes(32)
def prop(name, value):
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
ready = b"\\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b"")
junk = os.urandom(1 << 20)
out = {"sent": 0, "ended": 0}
sock = None
for _ in range(count):
    if sock is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(endpoint[len("ipc://"):])
        sock.sendall(greeting + bytes([0x04, len(ready)]) + ready)
    try:
        sock.sendall(b"\\x02" + struct.pack(">Q", size))
        left = size
        while left:
            left -= sock.send(junk[: min(left, len(junk))])
        out["sent"] += 1
    except (BrokenPipeError, ConnectionResetError):  # the daemon ended the connection
        out["ended"] += 1
        sock.close()
        sock = None
print(json.dumps(out), flush=True)
"""


def test_frames_before_any_hello_leave_the_daemons_memory_within_its_bound(
    users: dict[str, User], shared_dir: str
) -> None:
    serve = _serve_in_shared_dir(shared_dir)
    try:
        assert serve.process is not None
        pid = serve.process.pid
        a, b = users["odtrust-a"], users["odtrust-b"]
        shared = grp.getgrnam(SHARED_GROUP).gr_gid
        frame = ServerSettings().max_frame_bytes
        before = _status_kib(pid, "VmRSS") << 10

        def attack(count: int, size: int) -> dict[str, int]:
            command = [sys.executable, "-c", _BIG_FRAMES, serve.endpoint, str(b.uid)]
            command += [str(b.gid), str(shared), str(count), str(size)]
            done = subprocess.run(
                command, env=_ATTACK_ENV, cwd="/tmp", capture_output=True, text=True,
                timeout=300, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            report: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
            return report

        # 100 frames of 60 MiB, no Hello: each connection ends at the frame's header, before
        # libzmq reads a byte of it (before the fix each was read, queued and held).
        assert attack(100, 60 << 20) == {"sent": 0, "ended": 100}
        # 100 junk frames of max_frame_bytes on one connection: read, answered, dropped.
        assert attack(100, frame) == {"sent": 100, "ended": 0}
        # The bound stated in docs/security.md for peers without a session: the frames read
        # ahead (and the one read past the bound), the one being handled, and RCVHWM + 1 per
        # connection in libzmq (one connection here).
        bound = (offloadd.server.control._QUEUED_FRAMES + 2 + RCVHWM + 1) * frame
        peak = _status_kib(pid, "VmHWM") << 10
        assert peak - before <= bound, (peak - before) >> 20
        victim = run_as(a, serve.endpoint, "--engine", "victim", "--store", "mine")
        assert victim.get("connected") and victim["stored"] == 4, victim
        seen = run_as(a, serve.endpoint, "--engine", "victim-2", "--lookup", "mine")
        assert seen["hits"] == 4, seen
        after = _status_kib(pid, "VmRSS") << 10
        assert after - before <= bound, (after - before) >> 20
        print(f"\nRSS {before >> 20} MiB before, peak +{(peak - before) >> 20} MiB, "
              f"+{(after - before) >> 20} MiB after (bound +{bound >> 20} MiB)")  # fmt: skip
    finally:
        serve.stop()


_STEP_FLOOD = """
import json, os, sys, uuid, zmq
from offloadd.peer import register
from protocol import PROTOCOL_VERSION
from protocol.messages import Hello, Lookup, Reserve, Welcome, decode_reply, encode
from tests.integration.configs import make_config
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
big, small, sessions = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "sessions"
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
ctx = zmq.Context()
socks = []
for index in range(4):  # without a session (the daemon knows nothing of them), or with one
    identity = uuid.uuid4().bytes
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # answers unread: the daemon drops them
    sock.connect(endpoint)
    socks.append(sock)
    if sessions:  # a scheduler whose engine waits for its rank: each lookup is refused
        token = register(endpoint, identity, []).token
        config = make_config(engine_id=f"flood-{index}", tp=1)
        sock.send(encode(Hello(1, PROTOCOL_VERSION, "scheduler", config, token=token)))
        assert sock.poll(30_000) and isinstance(decode_reply(sock.recv()), Welcome)
# Within every bound: 4,096 lookups of 256 keys each (1,048,576 keys, a 14 MiB frame), and
# 4,096 lookups of no key (243 KiB, read as a control request).
wide = encode(Reserve(5, [], lookups=[Lookup(100 + i, [bytes(12)] * 256) for i in range(4096)]))
empty = encode(Reserve(6, [], lookups=[Lookup(100 + i, []) for i in range(4096)]))
for index in range(big + small):
    socks[index % 4].send(wide if index < big else empty, copy=False)
print(json.dumps({"sent": big + small, "wide": len(wide)}), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("flood", ["sessionless", "sessions"])
def test_a_flood_of_step_messages_keeps_the_loop_turning(
    users: dict[str, User], shared_dir: str, flood: str
) -> None:
    # systemd's watchdog protocol: the daemon pings from its event loop every half interval,
    # so the gaps between pings are its loop's longest turns (plus the 50 ms interval).
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(os.path.join(shared_dir, "notify"))
    notify.settimeout(0.2)
    serve = _serve_in_shared_dir(
        shared_dir, NOTIFY_SOCKET=os.path.join(shared_dir, "notify"), WATCHDOG_USEC="100000"
    )
    pings: list[float] = []
    health: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                if b"WATCHDOG=1" in notify.recv(4096):
                    pings.append(time.monotonic())

    def probe() -> None:  # as the kubelet's liveness probe would, 10 times a second
        while not stop.is_set():
            health.append(scrape_unix(serve.metrics_path, "/healthz").split(" ", 2)[1])
            stop.wait(0.1)

    threads = [threading.Thread(target=watch), threading.Thread(target=probe)]
    for thread in threads:
        thread.start()
    a, b = users["odtrust-a"], users["odtrust-b"]
    shared = grp.getgrnam(SHARED_GROUP).gr_gid
    big, small = 16, 64
    try:
        with OffloadClient(serve.endpoint, heartbeat=0) as admin:
            errors = admin.stats().protocol_errors
            _until(lambda: len(pings) > 3, "the watchdog's first pings")
            began = time.monotonic()
            command = [sys.executable, "-c", _STEP_FLOOD, serve.endpoint, str(b.uid)]
            command += [str(b.gid), str(shared), str(big), str(small), flood]
            attacker = subprocess.Popen(
                command, env=_ATTACK_ENV, cwd="/tmp", text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            try:
                assert attacker.stdout is not None and attacker.stderr is not None
                line = attacker.stdout.readline()
                assert line, attacker.stderr.read()
                # The victim is served while the flood is handled.
                victim = run_as(a, serve.endpoint, "--engine", "victim", "--store", "mine")
                assert victim.get("connected") and victim["stored"] == 4, victim
                # Every message refused (a count the daemon keeps), the flood handled whole
                # before the clock stops: without a session, one NOT_REGISTERED a message,
                # its lookups unread; with one, each of its 4,096 lookups answered too
                # (ENGINE_NOT_READY), in quanta.
                answers = 1 if flood == "sessionless" else 4097
                expected = errors + (big + small) * answers
                _until(lambda: admin.stats().protocol_errors >= expected, "the flood's end", 120)
                ended = time.monotonic()
            finally:
                attacker.communicate("", timeout=60)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        serve.stop()
        notify.close()
    gaps = [later - earlier for earlier, later in itertools.pairwise(pings) if later > began]
    assert pings[-1] > ended and gaps
    # The stated bound is 5 ms of requests then one item per turn (docs/security.md); a gap
    # is asserted with a wide margin for a shared machine: 1 s, where 4,096 empty lookups
    # per frame held the loop 2.3 s at a time before, and 5 s per frame in the review.
    assert max(gaps) < 1.0, sorted(gaps)[-5:]
    assert set(health) == {"200"}, {code: health.count(code) for code in set(health)}
    print(f"\n{flood}: {len(gaps)} watchdog gaps in the flood, longest {max(gaps) * 1e3:.0f} ms")


_HELLO_CHURN = """
import json, os, sys, uuid, zmq
from offloadd.peer import register
from protocol import PROTOCOL_VERSION
from protocol.messages import Bye, Hello, Welcome, decode_reply, encode
from tests.integration.configs import make_config
endpoint, uid, gid, groups = sys.argv[1], *map(int, sys.argv[2:5])
cycles = int(sys.argv[5])
os.setgroups([groups]); os.setgid(gid); os.setuid(uid)
ctx = zmq.Context()
welcomed = 0
for index in range(cycles):  # each Hello and each Bye a line in the daemon's log
    identity = uuid.uuid4().bytes
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    token = register(endpoint, identity, []).token
    config = make_config(engine_id=f"churn-{index % 8}", tp=1)
    sock.send(encode(Hello(1, PROTOCOL_VERSION, "scheduler", config, token=token)))
    assert sock.poll(30_000), "no Welcome"
    welcomed += isinstance(decode_reply(sock.recv()), Welcome)
    sock.send(encode(Bye(2)))
    assert sock.poll(30_000), "no answer to Bye"
    sock.recv()
    sock.close()
print(json.dumps({"welcomed": welcomed}), flush=True)
"""


def test_one_users_log_lines_are_limited_and_anothers_still_logged(
    users: dict[str, User], shared_dir: str
) -> None:
    serve = _serve_in_shared_dir(shared_dir, log_level="INFO")
    try:
        a, b = users["odtrust-a"], users["odtrust-b"]
        shared = grp.getgrnam(SHARED_GROUP).gr_gid
        cycles = 400
        command = [sys.executable, "-c", _HELLO_CHURN, serve.endpoint, str(b.uid)]
        command += [str(b.gid), str(shared), str(cycles)]
        churn = subprocess.run(
            command, env=_ATTACK_ENV, cwd="/tmp", capture_output=True, text=True,
            timeout=300, check=False,
        )  # fmt: skip
        assert churn.returncode == 0, churn.stderr
        assert json.loads(churn.stdout.strip().splitlines()[-1]) == {"welcomed": cycles}
        victim = run_as(a, serve.endpoint, "--engine", "victim", "--store", "mine")
        assert victim.get("connected") and victim["stored"] == 4, victim
        log = serve.log()
    finally:
        serve.stop()
    # B's 800 lifecycle lines (a Hello and a Bye each cycle): its burst (64) and about one a
    # second after it went out, the rest held back and counted; A's lines all went out.
    churned = [line for line in log.splitlines() if "engine churn-" in line]
    assert 64 <= len(churned) < 64 + 30, len(churned)
    assert f"uid {a.uid}" in log and "engine victim dp 0 rank 0 connected" in log
    print(f"\n{len(churned)} of {2 * cycles} lines of uid {b.uid} logged")
