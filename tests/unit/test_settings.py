"""Settings: defaults < TOML < environment < flags, and errors that name the setting and source."""

from __future__ import annotations

import grp
import io
import json
import logging
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from offloadd.server.preflight import PreflightError, preflight, raise_on_failure
from offloadd.settings import (
    CacheSettings,
    LogSettings,
    ServerSettings,
    Settings,
    SettingsError,
    TenancySettings,
    configure_logging,
    load_settings,
    parse_address,
    physical_memory,
    settings_toml,
)

NO_ENV: dict[str, str] = {}


@pytest.fixture
def toml(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "offloadd.toml"


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --- precedence ------------------------------------------------------------------------------


def test_no_file_no_env_gives_the_defaults() -> None:
    assert load_settings(environ=NO_ENV) == Settings()


def test_each_layer_overrides_the_one_below(toml: Path) -> None:
    path = write(
        toml,
        """
[cache]
capacity = "2GiB"
policy = "arc"
persist = false
[server]
session_timeout = 12
drain_seconds = 3.5
[events]
enabled = false
[log]
level = "DEBUG"
""",
    )
    env = {
        "OFFLOADD_CACHE__CAPACITY": "4GiB",
        "OFFLOADD_SERVER__SESSION_TIMEOUT": "10",
        "OFFLOADD_EVENTS__ENABLED": "true",
        "UNRELATED": "x",
    }
    flags = {"cache": {"capacity": "8GiB"}, "log": {"level": "WARNING"}}

    from_file = load_settings(path, environ=NO_ENV)
    assert from_file.cache == CacheSettings(capacity=2 << 30, policy="arc", persist=False)
    assert from_file.server.session_timeout == 12.0
    assert from_file.server.drain_seconds == 3.5
    assert from_file.events.enabled is False
    assert from_file.log.level == "DEBUG"

    with_env = load_settings(path, environ=env)
    assert with_env.cache.capacity == 4 << 30
    assert with_env.cache.policy == "arc"  # untouched by env: the file's value stays
    assert with_env.server.session_timeout == 10.0
    assert with_env.server.drain_seconds == 3.5
    assert with_env.events.enabled is True

    with_flags = load_settings(path, environ=env, overrides=flags)
    assert with_flags.cache.capacity == 8 << 30
    assert with_flags.log.level == "WARNING"
    assert with_flags.server.session_timeout == 10.0  # no flag: env still wins over the file


def test_env_values_take_each_field_type() -> None:
    settings = load_settings(
        environ={
            "OFFLOADD_SERVER__RECENT_JOBS": " 17 ",
            "OFFLOADD_SERVER__DRAIN_SECONDS": "2.5",
            "OFFLOADD_SERVER__SHM_DIRS": "/dev/shm, /run/shm,",
            "OFFLOADD_SERVER__MAX_FRAME_BYTES": "1MiB",
            "OFFLOADD_CACHE__POLICY": "arc",
            "OFFLOADD_CACHE__PERSIST": "no",
            "OFFLOADD_EVENTS__PORT_PER_DP": "YES",
            "OFFLOADD_EVENTS__REPLAY_ENDPOINT": "",
            "OFFLOADD_LOG__FORMAT": "journal",
            "OFFLOADD_METRICS__ADDRESS": "[::1]:9000",
        }
    )
    assert settings.server.recent_jobs == 17
    assert settings.server.drain_seconds == 2.5
    assert settings.server.shm_dirs == ("/dev/shm", "/run/shm")
    assert settings.server.max_frame_bytes == 1 << 20
    assert settings.cache.policy == "arc"
    assert settings.cache.persist is False
    assert settings.events.port_per_dp is True
    assert settings.events.replay_endpoint == ""
    assert settings.log.format == "journal"
    assert settings.metrics.address == "[::1]:9000"


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("0", False), ("False", False)])
def test_env_booleans(text: str, expected: bool) -> None:
    assert load_settings(environ={"OFFLOADD_CACHE__PERSIST": text}).cache.persist is expected


def test_sizes_in_toml_as_strings_or_integers(toml: Path) -> None:
    path = write(toml, '[cache]\ncapacity = "512MiB"\n[server]\nmax_frame_bytes = 65536\n')
    settings = load_settings(path, environ=NO_ENV)
    assert settings.cache.capacity == 512 << 20
    assert settings.server.max_frame_bytes == 65536


def test_sizes_in_si_units_are_decimal_and_in_iec_units_binary(toml: Path) -> None:
    path = write(toml, '[cache]\ncapacity = "8GB"\n[disk]\ncapacity = "200GiB"\n')
    settings = load_settings(path, environ=NO_ENV)
    assert settings.cache.capacity == 8_000_000_000
    assert settings.disk.capacity == 200 << 30
    from_env = load_settings(environ={"OFFLOADD_CACHE__CAPACITY": "8GiB"})
    assert from_env.cache.capacity == 8 << 30


def test_a_size_with_a_bare_unit_names_the_setting_and_both_readings(toml: Path) -> None:
    path = write(toml, '[cache]\ncapacity = "8G"\n')
    assert error_of(path) == (
        "cache.capacity: '8G' is ambiguous: write 8GiB (8589934592 bytes) or 8GB "
        f"(8000000000 bytes) (from {path})"
    )
    message = error_of(env={"OFFLOADD_DISK__CAPACITY": "200g"})
    assert message.startswith("disk.capacity: '200g' is ambiguous: write 200GiB")
    assert message.endswith("(from OFFLOADD_DISK__CAPACITY)")


def test_lists_in_toml(toml: Path) -> None:
    path = write(toml, '[server]\nshm_dirs = ["/dev/shm", "/mnt/shm"]\n')
    assert load_settings(path, environ=NO_ENV).server.shm_dirs == ("/dev/shm", "/mnt/shm")


def test_metrics_can_be_turned_off() -> None:
    settings = load_settings(environ={"OFFLOADD_METRICS__ADDRESS": ""})
    assert settings.metrics.address == ""
    assert Settings().metrics.address == "auto"


def test_events_and_metrics_default_to_sockets_beside_the_control_socket() -> None:
    settings = Settings(server=ServerSettings(endpoint="ipc:///run/x/d.sock")).exposed()
    assert settings.events.endpoint == "ipc:///run/x/d.sock.events"
    assert settings.events.replay_endpoint == "ipc:///run/x/d.sock.replay"
    assert settings.metrics.address == "unix:/run/x/d.sock.metrics"
    # Only the daemon's user (and root) read the metrics: they name every tenant's engines.
    assert (settings.metrics.socket_mode, settings.metrics.socket_group) == ("0600", "")
    assert "{tenant}" in settings.events.topic_template
    # tcp is an explicit setting; "auto" replay beside it is its next port, as vLLM's.
    tcp = load_settings(
        environ={
            "OFFLOADD_SERVER__ENDPOINT": "ipc:///run/x/d.sock",
            "OFFLOADD_EVENTS__ENDPOINT": "tcp://0.0.0.0:6000",
            "OFFLOADD_METRICS__ADDRESS": "0.0.0.0:9464",
        }
    ).exposed()
    assert tcp.events.replay_endpoint == "tcp://0.0.0.0:6001"
    assert tcp.metrics.address == "0.0.0.0:9464"
    # Off stays off; a tcp control endpoint puts them beside the default ipc one.
    off = load_settings(
        environ={"OFFLOADD_EVENTS__REPLAY_ENDPOINT": "", "OFFLOADD_METRICS__ADDRESS": ""}
    )
    assert off.exposed().events.replay_endpoint == "" and off.exposed().metrics.address == ""
    remote = Settings(server=ServerSettings(endpoint="tcp://127.0.0.1:7000")).exposed()
    assert remote.events.endpoint.startswith("ipc://") and remote.events.endpoint.endswith(
        "offloadd.sock.events"
    )


def test_a_control_path_leaves_room_for_the_sockets_beside_it() -> None:
    path = "/tmp/" + "p" * (107 - len("/tmp/") - len(".metrics"))
    assert load_settings(environ={"OFFLOADD_SERVER__ENDPOINT": f"ipc://{path}"})
    with pytest.raises(SettingsError, match=r"PATH\.metrics"):
        load_settings(environ={"OFFLOADD_SERVER__ENDPOINT": f"ipc://{path}x"})


# --- errors ----------------------------------------------------------------------------------


def error_of(path: str | None = None, env: dict[str, str] | None = None, **flags: object) -> str:
    with pytest.raises(SettingsError) as caught:
        load_settings(path, environ=env or NO_ENV, overrides=flags or None)  # type: ignore[arg-type]
    return str(caught.value)


def test_the_per_tenant_limits_are_checked() -> None:
    message = error_of(env={"OFFLOADD_LIMITS__TENANT_PROTECTED_FRACTION": "1.5"})
    assert message.startswith("limits.tenant_protected_fraction: expected a fraction")
    message = error_of(env={"OFFLOADD_LIMITS__RESERVATION_SECONDS": "0"})
    assert message.startswith("limits.reservation_seconds: expected a number above 0")
    message = error_of(env={"OFFLOADD_LIMITS__MAPPED_BYTES_PER_UID": "-1"})
    assert message.startswith("limits.mapped_bytes_per_uid: expected a number at least 0")
    # 0: the engine's fraction again, per tenant; the host's memory per uid.
    limits = load_settings(None, environ={"OFFLOADD_LIMITS__TENANT_PROTECTED_FRACTION": "0"}).limits
    assert limits.tenant_protected_fraction == 0 and limits.mapped_bytes_per_uid == 0


def test_the_events_sockets_take_the_control_sockets_mode_and_group_unless_given() -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    server = {"OFFLOADD_SERVER__SOCKET_MODE": "0640", "OFFLOADD_SERVER__SOCKET_GROUP": group}
    settings = load_settings(environ=server)
    assert (settings.events.socket_mode, settings.events.socket_group) == ("", "")
    events = settings.exposed().events  # what the daemon binds with
    assert (events.socket_mode, events.socket_group) == ("0640", group)
    # Their own: a monitoring group, or the daemon's user alone; the control socket unchanged.
    own = load_settings(
        environ={
            **server,
            "OFFLOADD_EVENTS__SOCKET_MODE": "0600",
            "OFFLOADD_EVENTS__SOCKET_GROUP": group,
        }
    ).exposed()
    assert (own.events.socket_mode, own.events.socket_group) == ("0600", group)
    assert (own.server.socket_mode, own.server.socket_group) == ("0640", group)
    # With "auto" endpoints off, still made concrete.
    tcp = load_settings(
        environ={
            "OFFLOADD_EVENTS__ENDPOINT": "tcp://127.0.0.1:6000",
            "OFFLOADD_EVENTS__REPLAY_ENDPOINT": "",
            "OFFLOADD_METRICS__ADDRESS": "",
        }
    ).exposed()
    assert (tcp.events.socket_mode, tcp.events.socket_group) == ("0660", "")


def test_the_events_socket_mode_and_group_are_checked() -> None:
    message = error_of(env={"OFFLOADD_EVENTS__SOCKET_MODE": "rw-rw----"})
    assert message.startswith("events.socket_mode: expected octal permission bits such as")
    assert "for the control socket's" in message and "OFFLOADD_EVENTS__SOCKET_MODE" in message
    message = error_of(env={"OFFLOADD_EVENTS__SOCKET_GROUP": "no-such-group-od"})
    assert message.startswith("events.socket_group: no group 'no-such-group-od' on this host")
    assert "for the control socket's (server.socket_group)" in message


def test_check_config_says_whose_events_socket_mode_applies() -> None:
    text = settings_toml(load_settings(environ=NO_ENV))
    assert 'socket_mode = ""  # the control socket\'s: 0660' in text.splitlines()
    assert 'socket_group = ""  # the control socket\'s: left as created' in text.splitlines()


def test_unknown_key_in_env_names_key_and_variable() -> None:
    message = error_of(env={"OFFLOADD_CACHE__CAPASITY": "8GiB"})
    assert message.startswith("unknown setting cache.capasity (from OFFLOADD_CACHE__CAPASITY)")
    assert "did you mean cache.capacity?" in message


def test_unknown_section_in_env() -> None:
    message = error_of(env={"OFFLOADD_CAHCE__CAPACITY": "8GiB"})
    assert "unknown settings section [cahce] (from OFFLOADD_CAHCE__CAPACITY)" in message
    assert "[cache]" in message


def test_single_underscore_after_the_section_is_caught() -> None:
    message = error_of(env={"OFFLOADD_CACHE_CAPACITY": "8GiB"})
    assert "OFFLOADD_CACHE_CAPACITY" in message and "OFFLOADD_CACHE__CAPACITY" in message


def test_other_offloadd_variables_are_left_alone() -> None:
    assert load_settings(environ={"OFFLOADD_SOMETHING_ELSE": "1"}) == Settings()


def test_unknown_key_and_section_in_toml(toml: Path) -> None:
    path = write(toml, "[cache]\ncapasity = 1\n")
    assert error_of(path).startswith(f"unknown setting cache.capasity (from {path})")
    path = write(toml, "[cahce]\ncapacity = 1\n")
    assert f"unknown settings section [cahce] (from {path})" in error_of(path)
    path = write(toml, "capacity = 1\n")
    message = error_of(path)
    assert "capacity" in message and "[cache]" in message and path in message


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("server.recent_jobs", "abc", "expected an integer, got 'abc'"),
        ("server.recent_jobs", "1.5", "expected an integer, got '1.5'"),
        ("events.enabled", "maybe", "expected true or false, got 'maybe'"),
        ("server.drain_seconds", "soon", "expected a number, got 'soon'"),
        ("cache.capacity", "lots", "expected a size like 8GiB, got 'lots'"),
        ("cache.capacity", "0", "expected a size like 8GiB, got '0'"),
        ("cache.policy", "fifo", "expected one of 'lru', 'arc', got 'fifo'"),
        ("log.format", "xml", "expected one of 'auto', 'plain', 'journal', 'json', got 'xml'"),
        ("log.level", "LOUD", "expected one of CRITICAL, ERROR, WARNING, INFO, DEBUG, NOTSET"),
        ("metrics.address", "9464", "expected HOST:PORT"),
    ],
)
def test_wrong_type_in_env_names_field_and_source(name: str, value: str, expected: str) -> None:
    variable = "OFFLOADD_" + name.upper().replace(".", "__")
    message = error_of(env={variable: value})
    assert message.startswith(f"{name}: {expected}")
    assert message.endswith(f"(from {variable})")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('[cache]\ncapacity = "lots"', "cache.capacity: expected a size like 8GiB, got 'lots'"),
        ("[cache]\ncapacity = true", "cache.capacity: expected a size like 8GiB, got True"),
        ('[server]\nrecent_jobs = "10"', "server.recent_jobs: expected an integer, got '10'"),
        ('[cache]\npersist = "yes"', "cache.persist: expected true or false, got 'yes'"),
        ('[cache]\npolicy = "fifo"', "cache.policy: expected one of 'lru', 'arc', got 'fifo'"),
        ('[server]\nshm_dirs = "/dev/shm"', "server.shm_dirs: expected a list of strings"),
        ("cache = 3", "[cache] must be a table"),
    ],
)
def test_wrong_type_in_toml_names_field_and_file(toml: Path, body: str, expected: str) -> None:
    path = write(toml, body + "\n")
    message = error_of(path)
    assert message.startswith(expected)
    assert message.endswith(f"(from {path})")


def test_wrong_flag_value_names_the_command_line() -> None:
    message = error_of(cache={"capacity": "lots"})
    assert (
        message == "cache.capacity: expected a size like 8GiB, got 'lots' (from the command line)"
    )


def test_unreadable_and_malformed_files(toml: Path) -> None:
    assert "cannot read settings file" in error_of(str(toml))
    path = write(toml, "[cache\n")
    assert f"{path} is not valid TOML" in error_of(path)


# --- output, addresses, logging --------------------------------------------------------------


def test_settings_toml_reads_back_as_the_same_settings(toml: Path) -> None:
    settings = load_settings(
        environ={
            "OFFLOADD_CACHE__CAPACITY": "3GiB",
            "OFFLOADD_SERVER__SHM_DIRS": "/a,/b",
            "OFFLOADD_EVENTS__TOPIC_TEMPLATE": 'kv "quoted" {pod}',
            "OFFLOADD_METRICS__ADDRESS": "",
        }
    )
    text = settings_toml(settings)
    assert "capacity = 3221225472  # 3.0GiB" in text
    assert load_settings(write(toml, text), environ=NO_ENV) == settings


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_address("[::1]:0") == ("::1", 0)
    for bad in ("9464", ":9464", "host:", "host:http", "host:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_logging_formats() -> None:
    record_logger = logging.getLogger("offloadd.test_settings")
    root = logging.getLogger()
    old_level = root.level
    try:
        journal = io.StringIO()
        handler = configure_logging(
            LogSettings(level="INFO"), stream=journal, environ={"JOURNAL_STREAM": "8:1234"}
        )
        record_logger.warning("one\nline")  # a message never splits a line
        record_logger.debug("hidden")
        assert journal.getvalue() == "<4>offloadd.test_settings: one\\nline\n"
        try:
            raise ValueError("boom")
        except ValueError:
            record_logger.exception("failed")
        lines = journal.getvalue().splitlines()[1:]
        assert lines[0] == "<3>offloadd.test_settings: failed"
        assert lines[-1] == "<3>ValueError: boom"  # a traceback keeps its lines, prefixed
        assert all(line.startswith("<3>") for line in lines)
        journal.seek(0)
        journal.truncate()

        plain = io.StringIO()
        second = configure_logging(LogSettings(level="DEBUG"), stream=plain, environ={})
        assert handler not in root.handlers  # replaced, not added to
        record_logger.debug("shown")
        line = plain.getvalue()
        assert line.endswith(" DEBUG offloadd.test_settings: shown\n")
        assert line[:4].isdigit()  # timestamped
        assert journal.getvalue() == ""

        forced = io.StringIO()
        configure_logging(
            LogSettings(format="journal"), stream=forced, environ={}
        )  # journal even outside systemd
        record_logger.error("bad")
        assert forced.getvalue() == "<3>offloadd.test_settings: bad\n"
        assert second not in root.handlers
    finally:
        for handler in list(root.handlers):
            if type(handler).__name__ == "_Handler":
                root.removeHandler(handler)
        root.setLevel(old_level)


# --- check-config ----------------------------------------------------------------------------


def check_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD_")}
    return subprocess.run(
        [sys.executable, "-m", "offloadd", "check-config", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**clean, **(env or {})},
    )


def test_check_config_prints_the_effective_settings(toml: Path) -> None:
    path = write(toml, '[cache]\ncapacity = "2GiB"\n')
    result = check_config("--config", path, env={"OFFLOADD_CACHE__POLICY": "arc"})
    assert result.returncode == 0, result.stderr
    assert path in result.stdout.splitlines()[0]
    assert "OFFLOADD_CACHE__POLICY" in result.stdout.splitlines()[0]
    printed = tomllib.loads(result.stdout)
    assert printed["cache"]["capacity"] == 2 << 30
    assert printed["cache"]["policy"] == "arc"
    assert printed["metrics"]["address"] == "auto"
    assert "unix:" in result.stdout.split("[metrics]")[1].splitlines()[1]  # where "auto" is

    as_json = check_config("--config", path, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["cache"]["capacity"] == 2 << 30


def test_check_config_fails_with_the_reason(toml: Path) -> None:
    path = write(toml, '[cache]\ncapacity = "1GiB"\n')
    result = check_config("--config", path, env={"OFFLOADD_CACHE__CAPASITY": "8GiB"})
    assert result.returncode == 2
    assert result.stdout == ""
    assert "unknown setting cache.capasity (from OFFLOADD_CACHE__CAPASITY)" in result.stderr


def test_the_journal_defaults_to_the_state_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(cache=CacheSettings(arena="/dev/shm/a.arena"))
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/offloadd:/var/lib/other")
    assert settings.journal_path() == "/var/lib/offloadd/a.arena.journal"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_STATE_HOME", "/home/u/.state")
    assert settings.journal_path() == "/home/u/.state/offloadd/a.arena.journal"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert settings.journal_path() == "/home/u/.local/state/offloadd/a.arena.journal"
    given = Settings(cache=CacheSettings(journal="/srv/j"))
    assert given.journal_path() == "/srv/j"


def test_json_log_lines() -> None:
    record_logger = logging.getLogger("offloadd.test_settings")
    root = logging.getLogger()
    old_level = root.level
    try:
        out = io.StringIO()
        handler = configure_logging(
            LogSettings(format="json"), stream=out, environ={"JOURNAL_STREAM": "8:1234"}
        )
        evil = 'x"}\n{"level": "CRITICAL", "message": "fake"}\x1b[2J\u2028'
        before = datetime.now(UTC) - timedelta(milliseconds=1)  # the line keeps milliseconds
        record_logger.warning("hello from %s", evil)
        after = datetime.now(UTC)
        try:
            raise ValueError("boom")
        except ValueError:
            record_logger.exception("failed")
        lines = out.getvalue().split("\n")
        assert lines[-1] == "" and len(lines) == 3  # one line per record, whatever it holds
        assert all(line.isascii() and line.isprintable() for line in lines)
        first, second = (json.loads(line) for line in lines[:2])
        assert first.keys() == {"time", "level", "logger", "message"}
        assert (first["level"], first["logger"]) == ("WARNING", "offloadd.test_settings")
        assert first["message"] == "hello from " + evil  # intact, only escaped
        moment = datetime.fromisoformat(first["time"])
        assert first["time"].endswith("Z") and moment.utcoffset() == timedelta(0)
        assert before <= moment <= after
        assert (second["level"], second["message"]) == ("ERROR", "failed")
        assert second["exc_info"].startswith("Traceback (most recent call last):")
        assert second["exc_info"].endswith("ValueError: boom")
        assert handler in root.handlers
    finally:
        for old in list(root.handlers):
            if type(old).__name__ == "_Handler":
                root.removeHandler(old)
        root.setLevel(old_level)


def test_client_strings_cannot_forge_log_lines() -> None:
    record_logger = logging.getLogger("offloadd.test_settings")
    root = logging.getLogger()
    old_level = root.level
    try:
        plain = io.StringIO()
        configure_logging(LogSettings(level="INFO"), stream=plain, environ={})
        evil = "engine-x\n2026-01-01 00:00:00,000 INFO offloadd.server.daemon: fake\x1b[2J\u2028"
        record_logger.info("hello from %s", evil)
        text = plain.getvalue()
        assert text.count("\n") == 1
        assert "engine-x\\n2026" in text and "\\x1b[2J\\u2028" in text
    finally:
        for handler in list(root.handlers):
            if type(handler).__name__ == "_Handler":
                root.removeHandler(handler)
        root.setLevel(old_level)


def test_choices_are_case_insensitive(toml: Path) -> None:
    path = write(toml, '[cache]\npolicy = "LRU"\n[log]\nformat = " Plain "\n')
    settings = load_settings(path)
    assert settings.cache.policy == "lru" and settings.log.format == "plain"
    env = load_settings(environ={"OFFLOADD_SERVER__COPY_ENGINE": "CPU"})
    assert env.server.copy_engine == "cpu"
    assert "expected one of 'lru', 'arc'" in error_of(cache={"policy": "MRU"})


def test_the_copy_engine_defaults_to_auto() -> None:
    assert Settings().server.copy_engine == "auto"


def test_a_capacity_below_one_chunk_is_refused(toml: Path) -> None:
    path = write(toml, "[cache]\ncapacity = 8\n")
    message = error_of(path)
    assert message.startswith("cache.capacity: 8 is 8 bytes, too small to hold a chunk")
    assert "with a unit (8GiB)" in message and path in message
    assert "too small" in error_of(cache={"capacity": "32KiB"})
    assert load_settings(overrides={"cache": {"capacity": "64KiB"}}).cache.capacity == 64 << 10


def test_a_capacity_above_the_machines_memory_is_refused_by_the_preflight() -> None:
    memory = physical_memory()
    assert memory > 0
    settings = load_settings(
        environ={}, overrides={"cache": {"capacity": str(memory + (1 << 30))}}
    )  # a file written for a bigger node is valid: the machine decides
    # (Or than its cgroup's limit, lower where there is one: offloadd.server.memory.)
    limit = r"(this machine's memory \(MemTotal\)|the memory limit of its cgroup \(.*\))"
    (arena,) = [c for c in preflight(settings) if c.what.startswith("cache.arena")]
    assert re.search(f"is more than {limit}, ", arena.problem), arena.problem
    with pytest.raises(PreflightError, match=rf"^cache.arena .*more than {limit}"):
        raise_on_failure(settings)


def test_cluster_tenants_name_local_tenants_by_uid_and_by_group(toml: Path) -> None:
    text = '[mooncake.tenants]\nalice = ["uid:1000", "gid:2000"]\n"team.b" = ["uid:01001"]\n'
    settings = load_settings(write(toml, text), environ=NO_ENV)
    assert settings.mooncake.cluster_tenants() == {
        "u1000": "alice",
        "g2000": "alice",
        "u1001": "team.b",
    }
    assert Settings().mooncake.cluster_tenants() == {}
    # settings_toml writes the mapping back as an inline table.
    assert load_settings(write(toml, settings_toml(settings)), environ=NO_ENV) == settings


def test_uid_ranges_name_tenants_and_are_checked(toml: Path) -> None:
    text = '[tenancy]\nuid_ranges = { team-b = ["42000-42999"], team-a = ["41000-41999", "7-7"] }\n'
    settings = load_settings(write(toml, text), environ=NO_ENV)
    assert settings.tenancy.uid_range_table() == [
        (7, 7, "team-a"),
        (41000, 41999, "team-a"),
        (42000, 42999, "team-b"),
    ]
    assert load_settings(write(toml, settings_toml(settings)), environ=NO_ENV) == settings
    for ranges, problem in (
        ('{ a = ["0-5"] }', "uid 0 is root"),
        ('{ a = ["5-1"] }', "is not FIRST-LAST"),
        ('{ a = ["1-4294967295"] }', "is not FIRST-LAST"),
        ('{ a = ["10"] }', "is not FIRST-LAST"),
        ("{ a = [] }", "tenant a: no range"),
        ('{ u1000 = ["1-5"] }', "one offloadd gives by itself"),
        ('{ remote = ["1-5"] }', "one offloadd gives by itself"),
        ('{ "a@b" = ["1-5"] }', "expected 1-64 of"),
        ('{ a = ["1-5"], b = ["5-9"] }', "uid 5 is in the ranges of both a and b"),
    ):
        with pytest.raises(SettingsError, match=f"^tenancy.uid_ranges: .*{re.escape(problem)}"):
            load_settings(write(toml, f"[tenancy]\nuid_ranges = {ranges}\n"), environ=NO_ENV)


def test_a_daemon_whose_own_uid_is_in_a_tenants_range_does_not_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 10001)  # the image's daemon user
    ranged = Settings(tenancy=TenancySettings(uid_ranges={"team": ["10000-10999"]}))
    (check,) = [c for c in preflight(ranged) if c.what == "tenancy.uid_ranges"]
    assert check.problem == (
        "the daemon's own uid 10001 is in tenant team's range 10000-10999: run the daemon as "
        "a uid no tenant has"
    )
    other = Settings(tenancy=TenancySettings(uid_ranges={"team": ["41000-41999"]}))
    assert [c.ok for c in preflight(other) if c.what == "tenancy.uid_ranges"] == [True]
    assert not [c for c in preflight(Settings()) if c.what == "tenancy.uid_ranges"]
