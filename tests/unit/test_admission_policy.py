"""deploy/kubernetes/admission-policy.yaml: its CEL run against pods, as the API server would.

No API server runs here, so the policy's expressions are evaluated with cel-python (the CEL
standard, which Kubernetes' CEL extends) plus the one Kubernetes extension they use,
``string.split``; the binding's namespace selector and the order of variables and validations
are applied as the API server applies them (an expression that fails to evaluate denies, as
``failurePolicy: Fail`` does). The cases are the issue-46 review's: a pod author choosing
another namespace's uid, the daemon's uid or root, or getting around the uid rule. What this
does not show: that a given API server accepts the policy (its type checker and cost limits
are stricter than cel-python's), and admission itself. tests/integration/test_kube_identity.py
runs the daemon against the uids the policy admits.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

celpy = pytest.importorskip("celpy")
celtypes = pytest.importorskip("celpy.celtypes")

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def _kind(name: str, kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in _docs(name) if doc["kind"] == kind]
    return found


POLICY = _kind("admission-policy.yaml", "ValidatingAdmissionPolicy")
BINDING = _kind("admission-policy.yaml", "ValidatingAdmissionPolicyBinding")
PARAMS = _kind("admission-policy.yaml", "ConfigMap")


def _split(text: Any, separator: Any) -> Any:
    """Kubernetes' ``string.split(separator)`` (cel-go's strings extension)."""
    return celtypes.ListType([celtypes.StringType(p) for p in str(text).split(str(separator))])


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    if expression not in _PROGRAMS:
        _PROGRAMS[expression] = _ENV.program(_ENV.compile(expression), functions={"split": _split})
    return _PROGRAMS[expression].evaluate(activation)


def _selected(namespace: str) -> bool:
    """Whether the binding's namespace selector takes ``namespace``."""
    selector = BINDING["spec"]["matchResources"]["namespaceSelector"]
    assert set(selector) == {"matchExpressions"}
    labels = {"kubernetes.io/metadata.name": namespace}
    for expression in selector["matchExpressions"]:
        assert expression["operator"] in ("In", "NotIn")
        inside = labels.get(expression["key"]) in expression["values"]
        if inside != (expression["operator"] == "In"):
            return False
    return True


def admit(pod: dict[str, Any], namespace: str, params: dict[str, Any] | None = None) -> list[str]:
    """The messages of the validations ``pod`` fails in ``namespace`` ([]: admitted)."""
    if not _selected(namespace):
        return []
    spec = POLICY["spec"]
    rules = spec["matchConstraints"]["resourceRules"]
    assert any("pods" in rule["resources"] and "CREATE" in rule["operations"] for rule in rules)
    activation: dict[str, Any] = {
        "object": celpy.json_to_cel(pod),
        "request": celpy.json_to_cel({"namespace": namespace, "operation": "CREATE"}),
        "params": celpy.json_to_cel(params or PARAMS),
    }
    variables: dict[Any, Any] = {}
    for variable in spec["variables"]:  # in order: each may use those before it
        activation["variables"] = celtypes.MapType(variables)
        variables[celtypes.StringType(variable["name"])] = _eval(variable["expression"], activation)
    activation["variables"] = celtypes.MapType(variables)
    failed = []
    for validation in spec["validations"]:
        if not _eval(validation["expression"], activation):
            message = validation.get("message") or str(
                _eval(validation["messageExpression"], activation)
            )
            failed.append(" ".join(message.split()))
    return failed


def _engine_pod() -> dict[str, Any]:
    """The shipped example vLLM pod, as the API server gets it."""
    return copy.deepcopy(_kind("example-vllm-pod.yaml", "Pod"))


ENGINE_NAMESPACE = _engine_pod()["metadata"]["namespace"]


def _with(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    pod = _engine_pod()
    change(pod)
    return pod


def _pod_uid(uid: int | None) -> Callable[[dict[str, Any]], None]:
    def change(pod: dict[str, Any]) -> None:
        if uid is None:
            del pod["spec"]["securityContext"]["runAsUser"]
        else:
            pod["spec"]["securityContext"]["runAsUser"] = uid

    return change


def _range(namespace: str) -> tuple[int, int]:
    first, last = PARAMS["data"][f"uids.{namespace}"].split("-")
    return int(first), int(last)


# ---------------------------------------------------------------- the shipped objects


def test_the_example_engine_pod_is_admitted_in_its_namespace() -> None:
    assert ENGINE_NAMESPACE in {key.removeprefix("uids.") for key in PARAMS["data"]}
    assert admit(_engine_pod(), ENGINE_NAMESPACE) == []


def test_the_daemon_pod_is_admitted_only_where_the_binding_trusts_it() -> None:
    daemonset = _kind("daemonset.yaml", "DaemonSet")
    pod = {"metadata": {}, "spec": copy.deepcopy(daemonset["spec"]["template"]["spec"])}
    assert admit(pod, daemonset["metadata"]["namespace"]) == []
    # The same pod in a tenant's namespace: uid 10001, hostPath /dev/shm, the init container
    # as root with CAP_CHOWN.
    refused = admit(pod, ENGINE_NAMESPACE)
    assert any("never 0 or the daemon's 10001" in message for message in refused), refused
    assert any("given capabilities" in message for message in refused), refused
    assert any("mounts no node path but /run/offloadd" in message for message in refused)


def test_the_policy_and_the_daemon_agree_on_the_ranges_and_the_daemons_uid() -> None:
    settings = tomllib.loads(_kind("configmap.yaml", "ConfigMap")["data"]["offloadd.toml"])
    daemon_ranges = settings["tenancy"]["uid_ranges"]
    policy_ranges = {
        key.removeprefix("uids."): [value]
        for key, value in PARAMS["data"].items()
        if key.startswith("uids.")
    }
    assert policy_ranges == daemon_ranges, "change both ConfigMaps together"
    assert settings["tenancy"]["uid_ranges_only"] is True
    containerfile = (ROOT / "deploy" / "Containerfile").read_text().replace("\\\n", "")
    uid = re.search(r"useradd .*--uid (\d+)", containerfile)
    assert uid and PARAMS["data"]["daemon-uid"] == uid[1]
    daemon_pod = _kind("daemonset.yaml", "DaemonSet")["spec"]["template"]["spec"]
    assert daemon_pod["securityContext"]["runAsUser"] == int(uid[1])
    env = {e["name"]: e.get("value") for e in daemon_pod["containers"][0]["env"]}
    assert PARAMS["data"]["host-paths"].split(",") == [env["RUNTIME_DIRECTORY"]]
    assert POLICY["spec"]["failurePolicy"] == "Fail"
    assert BINDING["spec"]["paramRef"]["parameterNotFoundAction"] == "Deny"
    assert BINDING["spec"]["validationActions"] == ["Deny"]


# ---------------------------------------------------------------- the review's attacks


def test_a_pod_cannot_take_another_namespaces_uid() -> None:
    other = next(
        key.removeprefix("uids.")
        for key in PARAMS["data"]
        if key.startswith("uids.") and key != f"uids.{ENGINE_NAMESPACE}"
    )
    mine, theirs = _range(ENGINE_NAMESPACE), _range(other)
    # The review's forgery: every engine ran as uid 1000, one team's chunks served another.
    for uid in (theirs[0], theirs[1], mine[0] - 1, mine[1] + 1, 1000):
        (message,) = admit(_with(_pod_uid(uid)), ENGINE_NAMESPACE)
        assert message == (
            "every container of a pod that reaches the node runs as an explicit uid "
            f"(runAsUser) of namespace {ENGINE_NAMESPACE}'s range {mine[0]}-{mine[1]}, never 0 "
            "or the daemon's 10001"
        ), uid
    for uid in (mine[0], mine[1]):
        assert admit(_with(_pod_uid(uid)), ENGINE_NAMESPACE) == []
        assert admit(_with(_pod_uid(uid)), other) != []


@pytest.mark.parametrize("uid", [10001, 0, None], ids=["daemon-uid", "root", "image-user"])
def test_a_pod_cannot_run_as_the_daemon_root_or_whatever_its_image_says(
    uid: int | None,
) -> None:
    assert len(admit(_with(_pod_uid(uid)), ENGINE_NAMESPACE)) == 1


def test_every_container_is_held_to_the_range_init_and_debug_ones_too() -> None:
    def container_as(where: str, uid: int) -> Callable[[dict[str, Any]], None]:
        def change(pod: dict[str, Any]) -> None:
            extra = {
                "name": "extra",
                "image": "busybox",
                "securityContext": {"runAsUser": uid, "allowPrivilegeEscalation": False},
            }
            pod["spec"].setdefault(where, []).append(extra)

        return change

    first, _ = _range(ENGINE_NAMESPACE)
    for where in ("containers", "initContainers", "ephemeralContainers"):
        assert admit(_with(container_as(where, first + 5)), ENGINE_NAMESPACE) == [], where
        for uid in (0, 10001):
            assert len(admit(_with(container_as(where, uid)), ENGINE_NAMESPACE)) == 1, where


@pytest.mark.parametrize(
    "security",
    [
        {"allowPrivilegeEscalation": True},
        {},  # allowPrivilegeEscalation unset: true for a non-root process by default
        {"allowPrivilegeEscalation": False, "privileged": True},
        {"allowPrivilegeEscalation": False, "capabilities": {"add": ["SETUID"]}},
    ],
    ids=["escalation", "escalation-unset", "privileged", "capability"],
)
def test_a_pod_cannot_raise_its_uid(security: dict[str, Any]) -> None:
    def change(pod: dict[str, Any]) -> None:
        pod["spec"]["containers"][0]["securityContext"] = security

    (message,) = admit(_with(change), ENGINE_NAMESPACE)
    assert "allowPrivilegeEscalation: false" in message


def test_a_pod_cannot_remap_its_uid_or_mount_other_node_paths() -> None:
    def user_namespace(pod: dict[str, Any]) -> None:
        pod["spec"]["hostUsers"] = False

    assert "hostUsers: false" in admit(_with(user_namespace), ENGINE_NAMESPACE)[0]
    for path in ("/dev/shm", "/", "/run", "/var/run/offloadd", "/run/offloadd/../"):

        def mount(pod: dict[str, Any], path: str = path) -> None:
            pod["spec"]["volumes"].append({"name": "node", "hostPath": {"path": path}})

        assert admit(_with(mount), ENGINE_NAMESPACE) == [
            "a tenant's pod mounts no node path but /run/offloadd"
        ], path


def test_a_namespace_without_a_range_may_not_reach_the_node() -> None:
    for access in ("hostIPC", "hostPID", "hostNetwork", "hostPath"):

        def change(pod: dict[str, Any], access: str = access) -> None:
            spec = pod["spec"]
            for key in ("hostIPC", "hostPID"):
                spec.pop(key)
            spec["volumes"] = [v for v in spec["volumes"] if "hostPath" not in v]
            if access == "hostPath":
                spec["volumes"].append({"name": "node", "hostPath": {"path": "/run/offloadd"}})
            else:
                spec[access] = True

        (message,) = admit(_with(change), "default")
        assert message.startswith("namespace default has no uid range"), access
    # A pod that does not reach the node is not this policy's business, as root or not.
    plain = {"metadata": {}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    assert admit(plain, "default") == [] == admit(plain, ENGINE_NAMESPACE)


def test_the_trusted_namespaces_are_left_to_their_administrators() -> None:
    root_on_the_node = _with(_pod_uid(0))
    for namespace in ("kube-system", "offloadd"):
        assert admit(root_on_the_node, namespace) == []


def test_missing_or_broken_parameters_deny() -> None:
    broken = copy.deepcopy(PARAMS)
    broken["data"][f"uids.{ENGINE_NAMESPACE}"] = "not-a-range"
    with pytest.raises(celpy.CELEvalError):
        admit(_engine_pod(), ENGINE_NAMESPACE, broken)
    assert cast(dict[str, Any], BINDING["spec"]["paramRef"])["name"] == PARAMS["metadata"]["name"]
