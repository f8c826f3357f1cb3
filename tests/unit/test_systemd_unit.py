"""systemd/offloadd.service is what docs/design.md (section 9) and the README describe; the
example TOML is the defaults."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from offloadd.settings import Settings, load_settings

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "offloadd.service"
EXAMPLE = SYSTEMD / "offloadd.toml"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values...]}}``; comments and blank lines skipped (systemd's syntax,
    minus line continuations, which the unit does not use)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), "line continuations are not expected"
        header = re.fullmatch(r"\[(\w+)\]", line)
        if header:
            current = sections.setdefault(header.group(1), {})
            continue
        assert current is not None, f"directive outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not a directive: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= missing"
    assert len(values) == 1, f"[{section}] {key}= given {len(values)} times"
    return values[0]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),  # SIGHUP reloads, never stops it
        ("WatchdogSec", "30"),
        ("Restart", "on-failure"),
        ("RestartSec", "2"),
        ("TimeoutStartSec", "600"),
        ("TimeoutStopSec", "60"),
        ("RuntimeDirectory", "offloadd"),
        ("RuntimeDirectoryMode", "0750"),
        ("RuntimeDirectoryPreserve", "restart"),
        ("StateDirectory", "offloadd"),
        ("StateDirectoryMode", "0700"),
        ("UMask", "0027"),
        ("User", "offloadd"),
        ("Group", "offloadd-clients"),
        ("LimitMEMLOCK", "infinity"),
        ("LimitNOFILE", "65536"),
        ("RemoveIPC", "no"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ReadWritePaths", "/dev/shm"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("LockPersonality", "yes"),
        ("RestrictRealtime", "yes"),
        ("CapabilityBoundingSet", ""),
        ("AmbientCapabilities", ""),
        ("SystemCallArchitectures", "native"),
        ("SystemCallErrorNumber", "EPERM"),
        ("RestrictNamespaces", "yes"),
        ("RestrictSUIDSGID", "yes"),
        ("ProtectKernelLogs", "yes"),
        ("ProtectHostname", "yes"),
        ("ProtectProc", "invisible"),
        ("PrivateMounts", "yes"),
    ],
)
def test_service_directive(unit: dict[str, dict[str, list[str]]], key: str, value: str) -> None:
    assert one(unit, "Service", key) == value


def test_start_limits_live_in_unit_section(unit: dict[str, dict[str, list[str]]]) -> None:
    assert int(one(unit, "Unit", "StartLimitIntervalSec")) > 0
    assert int(one(unit, "Unit", "StartLimitBurst")) > 0
    assert "StartLimitIntervalSec" not in unit["Service"]
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_exec_start_runs_offloadd_serve_with_the_config(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    command = one(unit, "Service", "ExecStart").split()
    assert command[0].endswith("/bin/offloadd")
    assert command[1] == "serve"
    assert command[command.index("--config") + 1] == "/etc/offloadd/offloadd.toml"


def test_no_hardening_that_hides_gpus_or_shm(unit: dict[str, dict[str, list[str]]]) -> None:
    # A private /dev hides /dev/nvidia* and /dev/shm; W^X breaks CUDA's JIT.
    # DynamicUser= implies RemoveIPC=yes: the arena would not survive a restart.
    # A device allow-list (DeviceAllow=, or ProtectClock= which implies one before systemd 253)
    # blocks every /dev/nvidia* node it does not name.
    # PrivateUsers= maps every peer's uid to "nobody" (tenants are told apart by uid);
    # ProcSubset=pid hides /proc/sys/kernel/random/boot_id (the journal) and /proc/driver/nvidia.
    # PrivateNetwork= cuts KV events, metrics, tcp:// endpoints and the cluster tier.
    for forbidden in (
        "PrivateDevices",
        "MemoryDenyWriteExecute",
        "DynamicUser",
        "DeviceAllow",
        "DevicePolicy",
        "ProtectClock",
        "PrivateUsers",
        "ProcSubset",
        "PrivateNetwork",
    ):
        assert forbidden not in unit["Service"], forbidden
    assert "MemoryMax" not in unit["Service"]  # commented: it must be sized to the arena
    assert re.search(r"^#\s*MemoryMax=", UNIT.read_text(), re.MULTILINE)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_systemd_analyze_knows_every_directive(tmp_path: Path) -> None:
    # Verify a copy that can load here: an existing binary, no user that may not exist.
    text = UNIT.read_text()
    text = re.sub(r"^ExecStart=.*$", f"ExecStart={sys.executable} -V", text, flags=re.MULTILINE)
    text = re.sub(r"^(User|Group)=.*\n", "", text, flags=re.MULTILINE)
    copy = tmp_path / "offloadd.service"
    copy.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = result.stdout + result.stderr
    for complaint in ("Unknown key", "Unknown section", "Unknown lvalue", "Failed to parse"):
        assert complaint not in output, output


def test_system_call_filter_is_the_service_set_less_privileged_calls_but_chown(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    # Order matters: the first line makes it an allow-list, the next remove then add back.
    # chown(2): the daemon chgrps its sockets to server.socket_group (endpoint.py).
    assert unit["Service"]["SystemCallFilter"] == ["@system-service", "~@privileged", "@chown"]


MAX_EXPOSURE = 4.5


def _analyze_security(*options: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", *options, str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "SYSTEMD_COLORS": "0"},
    )
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    return result


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_systemd_analyze_security_exposure_at_most_4_5() -> None:
    result = _analyze_security(f"--threshold={round(MAX_EXPOSURE * 10)}")
    output = result.stdout + result.stderr
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", output)
    assert found, output
    assert float(found.group(1)) <= MAX_EXPOSURE, output
    assert result.returncode == 0, output  # --threshold: non-zero above it


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_every_exposure_left_is_explained_in_a_comment() -> None:
    """Each item systemd-analyze still counts is named in the unit's comments (why it stays):
    "RootDirectory=/RootImage=" by its key, "SystemCallFilter=~@resources" by "@resources"."""
    result = _analyze_security("--json=short")
    assert result.returncode == 0, result.stderr
    comments = "\n".join(
        line for line in UNIT.read_text().splitlines() if line.lstrip().startswith("#")
    )
    unexplained = []
    for item in json.loads(result.stdout):
        if item["exposure"] is None or float(item["exposure"]) == 0:
            continue
        key, _, detail = item["name"].partition("=")
        detail = detail.removeprefix("~").rstrip("=")
        if detail and not detail.startswith("/"):
            # A set (@resources) or a family pattern (AF_(INET|INET6)), itself a regex.
            explained = re.search(detail, comments) is not None
        else:
            explained = re.search(rf"\b{re.escape(key)}=", comments) is not None
        if not explained:
            unexplained.append(item["name"])
    assert not unexplained, f"counted by systemd-analyze, not explained in the unit: {unexplained}"


def test_systemd_analyze_check_catches_unknown_directives(tmp_path: Path) -> None:
    """The check above would see a typo (so its silence means something)."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("needs systemd-analyze")
    copy = tmp_path / "typo.service"
    copy.write_text(f"[Service]\nExecStart={sys.executable} -V\nPrivateDevicez=yes\n")
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Unknown key" in result.stdout + result.stderr


# --- the example settings file ---------------------------------------------------------------

_COMMENTED = re.compile(r"^#(\w+ = .*)$")


def test_example_toml_loads_as_the_defaults() -> None:
    assert load_settings(str(EXAMPLE), environ={}) == Settings()


def test_example_toml_shows_every_setting_at_its_default(tmp_path: Path) -> None:
    # Uncommenting every "#key = value" line must change nothing: the values are the defaults.
    lines = EXAMPLE.read_text().splitlines()
    uncommented = [_COMMENTED.sub(r"\1", line) for line in lines]
    shown: dict[str, set[str]] = {}
    section = ""
    for line in uncommented:
        if line.startswith("["):
            section = line.strip("[]")
        elif re.match(r"^\w+ = ", line):
            shown.setdefault(section, set()).add(line.split(" = ")[0])
    path = tmp_path / "uncommented.toml"
    path.write_text("\n".join(uncommented) + "\n")
    assert load_settings(str(path), environ={}) == Settings()
    every = {name: set(values) for name, values in msgspec.to_builtins(Settings()).items()}
    assert shown == every
