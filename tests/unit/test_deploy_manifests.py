"""deploy/: the Kubernetes manifests against the Kubernetes schemas (offline, with
kubernetes-validate), the ServiceMonitor structurally, the manifests against each other and
the image, the alert rules and the dashboard's queries with promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from tests.deploy_series import DASHBOARD, ROOT, RULES, dashboard_queries

kubernetes_validate = pytest.importorskip("kubernetes_validate")

KUBERNETES = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))
# The oldest Kubernetes the manifests are meant for (admissionregistration.k8s.io/v1's
# ValidatingAdmissionPolicy), and the newest the schemas know.
VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


def _documents(path: Path) -> list[dict[str, Any]]:
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert documents, f"{path.name} holds no document"
    return documents


def _all() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in _documents(path)]


def _one(kind: str, name: str = "") -> dict[str, Any]:
    (found,) = [
        doc
        for doc in _all()
        if doc["kind"] == kind and (not name or doc["metadata"]["name"] == name)
    ]
    return found


def _daemon_container() -> dict[str, Any]:
    (container,) = _one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    return cast(dict[str, Any], container)


def _settings() -> dict[str, Any]:
    return tomllib.loads(_one("ConfigMap", "offloadd-config")["data"]["offloadd.toml"])


def _size(text: str) -> int:
    """A Kubernetes quantity (Gi, Mi) or an offloadd size (GiB, MiB) in bytes."""
    match = re.fullmatch(r"(\d+)\s*([KMGT])i(B?)", text)
    assert match, f"not a binary size: {text!r}"
    return int(match[1]) << (10 * "KMGT".index(match[2]) + 10)


def test_there_are_manifests() -> None:
    kinds = {doc["kind"] for doc in _all()}
    assert kinds == {
        "Namespace",
        "ConfigMap",
        "DaemonSet",
        "Service",
        "ServiceMonitor",
        "Pod",
        "NetworkPolicy",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }


@pytest.mark.parametrize("path", MANIFESTS, ids=[path.name for path in MANIFESTS])
@pytest.mark.parametrize("version", VERSIONS)
def test_manifest_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    for doc in _documents(path):
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
            continue
        # strict: an unknown or misspelt field is an error, not silently dropped.
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    daemonset = _one("DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostIpc"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[-1], strict=True)


def test_servicemonitor_is_well_formed_and_selects_the_service() -> None:
    monitor, service = _one("ServiceMonitor"), _one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert monitor["metadata"]["name"] and monitor["metadata"]["namespace"] == "offloadd"
    spec = monitor["spec"]
    assert set(spec) <= {"jobLabel", "namespaceSelector", "selector", "endpoints"}
    labels = service["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert service["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
    # job="offloadd", which OffloaddDown matches.
    assert labels[spec["jobLabel"]] == "offloadd"
    assert 'job="offloadd"' in RULES.read_text()
    port_names = {port["name"] for port in service["spec"]["ports"]}
    (endpoint,) = spec["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings"}
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    for relabel in endpoint["relabelings"]:
        assert set(relabel) <= {"sourceLabels", "targetLabel", "action", "regex", "replacement"}
    # The dashboard and the alerts group by node.
    assert {"targetLabel": "node"}.items() <= endpoint["relabelings"][0].items()


def test_service_and_probes_reach_the_metrics_address() -> None:
    address = _settings()["metrics"]["address"]
    host, port = address.rsplit(":", 1)
    assert host == "0.0.0.0", "probes and Prometheus come from outside the pod"
    container = _daemon_container()
    (metrics_port,) = container["ports"]
    assert metrics_port["containerPort"] == int(port)
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get == {"path": path, "port": metrics_port["name"]}
    (service_port,) = _one("Service")["spec"]["ports"]
    assert service_port["targetPort"] == metrics_port["name"]
    assert service_port["port"] == int(port)


def test_memory_is_the_capacity_plus_headroom() -> None:
    capacity = _size(_settings()["cache"]["capacity"])
    resources = _daemon_container()["resources"]
    request = _size(resources["requests"]["memory"])
    limit = _size(resources["limits"]["memory"])
    assert request == limit, "Guaranteed QoS"
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"]
    assert limit - capacity >= 2 << 30, "no headroom above cache.capacity"


def _image_env() -> dict[str, str]:
    final_stage = CONTAINERFILE.read_text().rsplit("\nFROM ", 1)[1]
    return dict(re.findall(r"^ENV (\w+)=(\S+)$", final_stage, re.MULTILINE))


def test_daemonset_mounts_what_the_image_points_at() -> None:
    container = _daemon_container()
    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    image_env = _image_env()
    for name in ("OFFLOADD_CONFIG", "RUNTIME_DIRECTORY", "STATE_DIRECTORY"):
        assert env[name] == image_env[name], name
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    volumes = {
        volume["name"]: volume
        for volume in _one("DaemonSet")["spec"]["template"]["spec"]["volumes"]
    }
    assert str(Path(env["OFFLOADD_CONFIG"]).parent) in mounts
    for path in (env["RUNTIME_DIRECTORY"], env["STATE_DIRECTORY"], "/dev/shm"):
        # On the node, so that a new pod finds the socket path, the journal and the arena.
        assert volumes[mounts[path]]["hostPath"]["path"] == path
    assert _settings()["cache"]["arena"].startswith("/dev/shm/")


def test_daemon_runs_as_the_images_user_and_the_engine_in_its_group() -> None:
    containerfile = CONTAINERFILE.read_text()
    uid = re.search(r"useradd .*--uid (\d+)", containerfile.replace("\\\n", ""))
    gid = re.search(r"groupadd .*--gid (\d+) (\S+)", containerfile)
    assert uid and gid
    assert re.search(rf"^USER {uid[1]}:{gid[1]}$", containerfile, re.MULTILINE)
    assert _settings()["server"]["socket_group"] == gid[2]
    pod = _one("DaemonSet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid[1])
    assert pod["securityContext"]["runAsGroup"] == int(gid[1])
    (init,) = pod["initContainers"]
    assert f"chown {uid[1]}:{gid[1]} /run/offloadd" in init["command"][-1]
    engine = _one("Pod")["spec"]
    assert engine["securityContext"]["runAsGroup"] == int(gid[1]), "the ranks' primary group"
    assert engine["hostIPC"] and engine["hostPID"] and pod["hostIPC"] and pod["hostPID"]


def _readme_kv_transfer_config() -> dict[str, Any]:
    readme = (ROOT / "README.md").read_text()  # the quickstart's vllm serve line
    command = re.search(r"vllm serve MODEL --kv-transfer-config '(.*?)'", readme, re.DOTALL)
    assert command, "README's vllm serve line"
    return cast(dict[str, Any], json.loads(command[1]))


def test_example_vllm_pod_uses_the_readme_config_and_the_daemons_socket() -> None:
    (container,) = _one("Pod")["spec"]["containers"]
    args = container["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config == _readme_kv_transfer_config()
    endpoint = config["kv_connector_extra_config"]["offloadd_endpoint"]
    socket_dir = str(Path(endpoint.removeprefix("ipc://")).parent)
    daemon_env = {item["name"]: item.get("value") for item in _daemon_container()["env"]}
    assert socket_dir == daemon_env["RUNTIME_DIRECTORY"]
    assert Path(endpoint).name == "offloadd.sock"
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in _one("Pod")["spec"]["volumes"]}
    assert volumes[mounts[socket_dir]["name"]]["hostPath"]["path"] == socket_dir
    assert mounts[socket_dir]["readOnly"], "connecting to a socket needs no write access"
    # The socket directory is the one node path: hostIPC brings the node's /dev/shm.
    assert [v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v] == [socket_dir]
    assert _one("Pod")["spec"]["hostIPC"]


def test_networkpolicy_admits_the_scraper_to_the_metrics_port_only() -> None:
    policy = _one("NetworkPolicy")
    spec = policy["spec"]
    daemonset = _one("DaemonSet")
    assert policy["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["egress"] == []
    (rule,) = spec["ingress"]
    (port,) = rule["ports"]
    (metrics_port,) = _daemon_container()["ports"]
    assert port == {"port": metrics_port["name"], "protocol": "TCP"}
    (source,) = rule["from"]
    # One namespace AND one kind of pod in it (both selectors in one entry), not either.
    assert set(source) == {"namespaceSelector", "podSelector"}
    assert source["podSelector"]["matchLabels"] and source["namespaceSelector"]["matchLabels"]


def test_a_node_label_stops_its_daemon_as_the_docs_say() -> None:
    pod = _one("DaemonSet")["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    ((expression,),) = [term["matchExpressions"] for term in terms["nodeSelectorTerms"]]
    label = f"{expression['key']}={expression['values'][0]}"
    assert expression["operator"] == "NotIn" and expression["values"] == ["off"]
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert f"kubectl label node NODE {label}" in docs
    assert f"kubectl label node NODE {expression['key']}-" in docs


# --- promtool ---------------------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: prometheus)"
)


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_fires_each_alert_on_its_cases() -> None:
    cases = RULES.with_name("offloadd-rules.test.yaml")
    tested = set(re.findall(r"alertname: (\w+)", cases.read_text()))
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    assert tested == alerts, "every alert has a case"
    result = _promtool("test", "rules", cases.name, cwd=cases.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def _as_recording_rules(queries: list[str]) -> str:
    """The dashboard's queries as recording rules, Grafana's variables filled in, so that
    promtool parses each as PromQL."""
    rules = []
    for number, query in enumerate(queries):
        expr = query.replace("$__rate_interval", "5m").replace("$node", ".*")
        expr = expr.replace("$engine", ".*")
        values = re.fullmatch(r"label_values\((\w+)(\{.*\})?, (\w+)\)", expr)
        if values:  # a variable's query: its series and label must be a selector
            expr = f"count by ({values[3]}) ({values[1]}{values[2] or ''})"
        rules.append({"record": f"dashboard:query_{number}", "expr": expr})
    return yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})


@needs_promtool
def test_every_dashboard_query_is_promql(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) > 20
    (tmp_path / "dashboard.yaml").write_text(_as_recording_rules(queries))
    result = _promtool("check", "rules", "dashboard.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # And a broken one would be caught.
    (tmp_path / "broken.yaml").write_text(
        _as_recording_rules(["sum by (node (offloadd_used_bytes)"])
    )
    assert _promtool("check", "rules", "broken.yaml", cwd=tmp_path).returncode != 0


def test_dashboard_is_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(target["expr"] for target in panel["targets"])
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard)))
    assert used - {"__rate_interval", "__all", "labels", "value"} <= variables
