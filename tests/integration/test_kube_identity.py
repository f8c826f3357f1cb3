"""The Kubernetes identity rule (issue 46) with real uids, as the shipped manifests run them.

On a cluster the tenant of an engine pod is its namespace: the admission policy
(deploy/kubernetes/admission-policy.yaml, whose CEL tests/unit/test_admission_policy.py runs
against pods) holds the pods of each namespace that reach the node to the uids of its range,
and the daemon, given the same ranges (the ConfigMap's ``[tenancy]``), names each rank's
tenant by the range its kernel uid lies in. Here the daemon runs as the image's user (uid
10001, the socket group its primary group, not root) with the ConfigMap's ``[tenancy]``, and
each "pod" is a process of the uid and primary group ``runAsUser`` and ``runAsGroup`` give it:
no passwd entry, as in a container. What no machine here can show (the API server admitting
or refusing the pods) is the admission policy's test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import held_report, system_group

REPO = Path(__file__).resolve().parents[2]
CONFIGMAP = REPO / "deploy" / "kubernetes" / "configmap.yaml"
DAEMON_UID = 10001  # the image's offloadd user (deploy/Containerfile, the DaemonSet)
GROUP = "odkube-clients"  # stands for the image's offloadd-clients (gid 10001)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="running as other uids needs root")


def _shipped_settings() -> str:
    (configmap,) = [doc for doc in yaml.safe_load_all(CONFIGMAP.read_text()) if doc]
    text: str = configmap["data"]["offloadd.toml"]
    return text


def _first_uid(tenant: str, offset: int = 0) -> int:
    """A uid of ``tenant``'s range in the ConfigMap (the namespace's, in the policy too)."""
    ranges = tomllib.loads(_shipped_settings())["tenancy"]["uid_ranges"][tenant]
    return int(ranges[0].split("-")[0]) + offset


@dataclass(frozen=True)
class Node:
    """A daemon as the DaemonSet runs it, and what a pod on its node needs to reach it."""

    endpoint: str  # where the daemon binds
    pod_endpoint: str  # the same socket through a read-only bind mount, where one can be made
    arena: str
    gid: int  # the socket group, every pod's primary group (runAsGroup)


@pytest.fixture(scope="module")
def group() -> Iterator[int]:
    with system_group(GROUP) as gid:
        yield gid


def _read_only_bind(source: str, target: str) -> bool:
    """Bind ``source`` at ``target`` read-only; False where this host lets no test mount."""
    bound = subprocess.run(["mount", "--bind", source, target], capture_output=True, check=False)
    if bound.returncode != 0:
        return False
    remount = ["mount", "-o", "remount,bind,ro", target]
    if subprocess.run(remount, capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", target], check=False)
        return False
    return True


def _drop_to(uid: int, gid: int) -> str:
    # The interpreter lives where only root reads (/root): import first, then become the user.
    return f"import os; os.setgroups([]); os.setgid({gid}); os.setuid({uid}); "


@pytest.fixture
def node(group: int) -> Iterator[Node]:
    """``offloadd serve`` as uid 10001 with the ConfigMap's offloadd.toml (the node's paths,
    size and copy engine put here instead), its socket directory 10001's and the group's,
    0750, as the DaemonSet's init container makes /run/offloadd; pods see that directory
    through a read-only bind mount, as the example pod's ``readOnly: true`` mounts it."""
    tag = uuid.uuid4().hex[:10]
    run_dir = tempfile.mkdtemp(prefix="od-kube-run-", dir="/tmp")
    pod_dir = tempfile.mkdtemp(prefix="od-kube-pod-", dir="/tmp")
    mounted = _read_only_bind(run_dir, pod_dir)
    shm_dir = f"/dev/shm/od-kube-{tag}"
    os.mkdir(shm_dir)
    for path, mode in ((run_dir, 0o750), (shm_dir, 0o700)):
        os.chown(path, DAEMON_UID, group)
        os.chmod(path, mode)
    config = f"{run_dir}/offloadd.toml"
    # This test's group stands for the image's offloadd-clients, which this host lacks (the
    # file is checked before the environment overrides it).
    text = _shipped_settings()
    assert 'socket_group = "offloadd-clients"' in text
    Path(config).write_text(text.replace('"offloadd-clients"', json.dumps(GROUP)))
    os.chmod(config, 0o644)
    endpoint, arena = f"ipc://{run_dir}/offloadd.sock", f"{shm_dir}/arena"
    argv = [
        "serve", "--config", config, "--endpoint", endpoint, "--arena", arena,
        "--capacity", "8MiB", "--no-persist", "--metrics-address", "", "--log-level", "WARNING",
    ]  # fmt: skip
    code = (
        "import sys, tomllib, offloadd.cli, offloadd.server.daemon, offloadd.server.metrics, "
        "offloadd.server.publisher, offloadd.cache.journal, pwd, grp; "
        + _drop_to(DAEMON_UID, group)
        + f"sys.exit(offloadd.cli.main({argv!r}))"
    )
    env = {
        "PYTHONPATH": str(REPO),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": run_dir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "OFFLOADD_SERVER__COPY_ENGINE": "cpu",  # this machine has no GPU
    }
    served = subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd="/tmp", stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(endpoint.removeprefix("ipc://") + ".peer"):
            assert served.poll() is None, f"the daemon did not start: {served.communicate()[1]}"
            assert time.monotonic() < deadline, "the daemon did not bind in time"
            time.sleep(0.05)
        pod_endpoint = endpoint.replace(run_dir, pod_dir) if mounted else endpoint
        yield Node(endpoint, pod_endpoint, arena, group)
    finally:
        served.terminate()
        _, err = served.communicate(timeout=60)
        if mounted:
            subprocess.run(["umount", pod_dir], check=False)
        os.rmdir(pod_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert served.returncode == 0, err


def _pod(node: Node, uid: int, *options: str) -> subprocess.Popen[str]:
    """tests.integration.peer_process as a pod's rank: ``uid``, the socket group primary."""
    command = [sys.executable, "-m", "tests.integration.peer_process", node.pod_endpoint]
    command += ["--user", str(uid), "--group", str(node.gid), *options]
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.Popen(
        command,
        env={**env, "PYTHONDONTWRITEBYTECODE": "1"},
        cwd="/tmp",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_pod(node: Node, uid: int, *options: str) -> dict[str, Any]:
    """A pod's rank as ``uid`` doing ``options``; its JSON report."""
    process = _pod(node, uid, *options)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert report["uid"] == uid and report["gid"] == node.gid
    return report


@contextlib.contextmanager
def held_pod(node: Node, uid: int, *options: str) -> Iterator[dict[str, Any]]:
    """A pod's rank keeping its session until the block ends."""
    with held_report(_pod(node, uid, *options, "--hold")) as report:
        yield report


def test_namespaces_never_share_cached_chunks_and_one_namespaces_uids_do(node: Node) -> None:
    a1, a2, b = _first_uid("team-a"), _first_uid("team-a", 1), _first_uid("team-b")
    # team-b's pod stores chunks under the keys team-a's engine would look up (content hashes
    # of a prompt both may know): the forgery of the review, where both ran as uid 1000.
    forged = run_pod(node, b, "--engine", "b-engine", "--store", "prompt")
    assert forged["stored"] == 4
    seen = run_pod(node, a1, "--engine", "a-engine", "--lookup", "prompt")
    assert seen["hits"] == 0, "another namespace's chunks were found"
    assert seen["namespace"] != forged["namespace"]
    # Two pods of team-a, of two uids of its range, are one tenant: replicas share.
    stored = run_pod(node, a2, "--engine", "a-replica", "--store", "team-a-prompt")
    assert stored["stored"] == 4 and stored["namespace"] == seen["namespace"]
    assert run_pod(node, a1, "--engine", "a-engine", "--lookup", "team-a-prompt")["hits"] == 4
    assert run_pod(node, b, "--engine", "b-engine", "--lookup", "team-a-prompt")["hits"] == 0


def test_each_namespace_sees_its_own_engines_and_not_anothers_session(node: Node) -> None:
    a1, a2, b = _first_uid("team-a"), _first_uid("team-a", 1), _first_uid("team-b")
    with (
        held_pod(node, a1, "--engine", "a-engine") as held_a,
        held_pod(node, b, "--engine", "b-engine") as held_b,
    ):
        assert held_a.get("connected") and held_b.get("connected")
        assert run_pod(node, a2, "--stats")["engines"] == ["a-engine"]
        assert run_pod(node, b, "--stats")["engines"] == ["b-engine"]
        # team-b naming team-a's engine is refused: the id is team-a's.
        taken = run_pod(node, b, "--engine", "a-engine")
        assert "belongs to another user" in taken["error"], taken
        # The daemon's own user (an admin, as `kubectl exec ds/offloadd -- offloadd status`
        # runs) still sees every engine.
        assert run_pod(node, DAEMON_UID, "--stats")["engines"] == ["a-engine", "b-engine"]


@pytest.mark.parametrize(
    ("uid", "who"),
    [(DAEMON_UID, " (the daemon's own user)"), (0, " (root)"), (1000, "")],
    ids=["daemon-uid", "root", "no-namespace"],
)
def test_a_uid_in_no_range_has_no_session(node: Node, uid: int, who: str) -> None:
    report = run_pod(node, uid, "--engine", f"outside-{uid}", "--store", "prompt")
    assert report["error"] == (
        f"NotPermitted: NOT_PERMITTED: uid {uid}{who} is in none of tenancy.uid_ranges, and "
        "uid_ranges_only admits only their engines: run the engine as a uid of its tenant's range"
    ), report
    assert "stored" not in report


def test_the_arena_is_out_of_every_tenants_reach(node: Node) -> None:
    for uid in (_first_uid("team-a"), _first_uid("team-b")):
        report = run_pod(node, uid, "--open", node.arena)
        assert report["opened"] == "Permission denied", report


def test_pods_reach_the_daemon_through_a_read_only_mount(node: Node) -> None:
    if node.pod_endpoint == node.endpoint:
        pytest.skip("this host lets no test bind-mount a directory")
    pod_dir = os.path.dirname(node.pod_endpoint.removeprefix("ipc://"))
    with open("/proc/self/mountinfo") as mounts:
        (options,) = [line.split()[5] for line in mounts if line.split()[4] == pod_dir]
    assert "ro" in options.split(","), options
    stored = run_pod(node, _first_uid("team-a"), "--engine", "a-engine", "--store", "ro")
    assert stored["stored"] == 4
