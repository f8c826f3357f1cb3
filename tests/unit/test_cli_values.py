"""Empty and malformed values everywhere a user can give one: every flag of every command,
every setting through the environment and through TOML.

Each either has a documented meaning (listed below, and what it then does is checked) or
is refused before anything starts: exit status 2 and one line on stderr that names the flag,
or the setting and where its value came from. Never a traceback: the commands run in this
process, so any exception fails the test.

The flags are read from the argument parser itself, so a flag added later is swept too; if
its empty or odd value is meant to be accepted, say so in DOCUMENTED_FLAGS. Nothing is ever
started: the daemon, the event watcher, the demo, the status query, the benchmarks and the
GPU check are replaced by recorders of what they would have been given.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

import offloadd.bench
import offloadd.demo
import offloadd.gpu_check
import offloadd.server.process
import offloadd.status
from offloadd import cli
from offloadd.settings import ENV_PREFIX, Settings

GARBAGE = "{garbage"
# Where the generic garbage would be a fine value (a relative file name to write).
GARBAGE_FOR = {
    ("bench", "--json"): "/nonexistent-offloadd-dir/results.json",
    ("check-gpu", "--json"): "/nonexistent-offloadd-dir/results.json",
}
# Arguments that make a command complete, swept flag aside (a later repeat of a flag wins).
BASE_ARGS = {
    "check-config": ["--json"],
    "status": ["--endpoint", "ipc:///tmp/od-sweep/none.sock"],
    "events": ["--endpoint", "ipc:///tmp/od-sweep/events.sock"],
}


@dataclass
class Recorder:
    """What the replaced actions were called with."""

    calls: list[tuple[str, Any]] = field(default_factory=list)

    def last(self, name: str) -> Any:
        matching = [value for called, value in self.calls if called == name]
        assert matching, f"{name} was not called: {self.calls}"
        return matching[-1]


def _settings_flag_checks(xdg: Path) -> dict[str, Callable[[Settings], bool]]:
    """What "" means for each settings flag that takes it (the setting's own meaning)."""
    return {
        "--endpoint": lambda s: (
            s.server.endpoint == "" and s.endpoint() == f"ipc://{xdg}/offloadd/offloadd.sock"
        ),
        "--arena": lambda s: s.cache.arena == "" and s.arena_path().startswith("/dev/shm/"),
        "--journal": lambda s: s.cache.journal == "" and s.journal_path().endswith(".journal"),
        "--events-endpoint": lambda s: s.events.endpoint == "",  # events off
        "--events-replay-endpoint": lambda s: s.events.replay_endpoint == "",  # no replay
        "--metrics-address": lambda s: s.metrics.address == "",  # no metrics server
    }


# (command, flag, value) -> what the command must then have been given.
DOCUMENTED_FLAGS: dict[tuple[str, str, str], Callable[[Recorder], bool]] = {
    ("events", "--replay", ""): lambda r: r.last("watch")[1] is None,  # no replay socket
    ("events", "--topic", ""): lambda r: r.last("watch")[2] == "",  # every topic
    ("events", "--topic", GARBAGE): lambda r: r.last("watch")[2] == GARBAGE,  # any prefix
}


def _value_flags() -> Iterator[tuple[str, str]]:
    """(command, flag) for every flag of every command that takes a value."""
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                for flag_action in sub._actions:
                    if flag_action.option_strings and flag_action.nargs != 0:
                        yield command, max(flag_action.option_strings, key=len)
        elif action.option_strings and action.nargs != 0:
            yield "", max(action.option_strings, key=len)


FLAG_CASES = [
    (command, flag, value)
    for command, flag in _value_flags()
    for value in ("", GARBAGE_FOR.get((command, flag), GARBAGE))
]


@pytest.fixture
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No OFFLOADD_* variables; a private runtime directory (the default endpoint's home)."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    yield tmp_path


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Replace everything that would start or reach something with a recorder."""
    record = Recorder()

    def run(
        settings: Settings, *, reload: Callable[[], Settings] | None = None, source: str = ""
    ) -> None:
        record.calls.append(("serve", settings))
        # What SIGHUP reads again: the same sources, so the same settings while none changed.
        assert reload is not None and reload() == settings

    async def watch(endpoint: str, replay: str | None, *, topic: str, as_json: bool) -> int:
        record.calls.append(("watch", (endpoint, replay, topic)))
        return 0

    def named(name: str) -> Callable[..., int]:
        def call(*args: Any, **kwargs: Any) -> int:
            record.calls.append((name, (args, kwargs)))
            return 0

        return call

    monkeypatch.setattr(offloadd.server.process, "run", run)
    monkeypatch.setattr(cli, "configure_logging", lambda log: None)  # keep the root logger
    monkeypatch.setattr(cli, "_watch_events", watch)
    monkeypatch.setattr(offloadd.demo, "main", named("demo"))
    monkeypatch.setattr(offloadd.status, "main", named("status"))
    monkeypatch.setattr(offloadd.bench, "main", named("bench"))
    monkeypatch.setattr(offloadd.gpu_check, "main", named("check-gpu"))
    return record


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``offloadd argv`` in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's way out
        assert isinstance(exc.code, int)
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_refused(status: int, err: str, *names: str) -> None:
    """Exit status 2 and one line on stderr naming every one of ``names``."""
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"


def test_the_sweep_covers_every_command() -> None:
    commands = {command for command, _flag, _value in FLAG_CASES}
    assert {
        "serve", "check-config", "status", "demo", "events", "bench", "check-gpu", "install"
    } <= commands  # fmt: skip
    assert ("events", "--daemon") in set(_value_flags())  # sanity: later flags are read too


@pytest.mark.parametrize(
    ("command", "flag", "value"), FLAG_CASES, ids=[f"{c} {f}={v!r}" for c, f, v in FLAG_CASES]
)
def test_every_flag_refuses_empty_and_garbage_or_means_something(
    command: str,
    flag: str,
    value: str,
    isolated: Path,
    recorder: Recorder,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ([command] if command else []) + BASE_ARGS.get(command, []) + [f"{flag}={value}"]
    status, out, err = run_cli(argv, capsys)

    settings_flag = cli.SETTINGS_FLAGS.get(flag) if command in ("serve", "check-config") else None
    empty_meaning = _settings_flag_checks(isolated).get(flag) if settings_flag else None
    if value == "" and empty_meaning is not None:
        assert status == 0, err
        if command == "serve":
            settings = recorder.last("serve")
        else:
            settings = msgspec.json.decode(out, type=Settings)
        assert empty_meaning(settings), settings
        return
    documented = DOCUMENTED_FLAGS.get((command, flag, value))
    if documented is not None:
        assert status == 0, err
        assert "Traceback" not in err
        assert documented(recorder), recorder.calls
        return
    names = [flag]
    if settings_flag is not None:
        section, key, _help = settings_flag
        names.append(f"{section}.{key}")
    assert_refused(status, err, *names)
    assert not recorder.calls, f"refused, yet went on to {recorder.calls}"


# --- every setting through the environment and TOML ----------------------------------------

SETTING_KEYS = [
    (section.name, key.name)
    for section in msgspec.structs.fields(Settings)
    for key in msgspec.structs.fields(section.type)
]
# Settings for which "" has a documented meaning (see offloadd.settings).
EMPTY_MEANS_SOMETHING = {
    ("server", "endpoint"),  # the default socket in the runtime directory
    ("server", "socket_group"),  # the group the socket is created with
    ("server", "curve_secret_key_file"),  # no CURVE
    ("server", "curve_clients_dir"),  # with CURVE: any client key
    ("cache", "arena"),  # /dev/shm/offloadd-<uid>/arena
    ("cache", "journal"),  # <state dir>/<arena name>.journal
    ("events", "endpoint"),  # events off
    ("events", "replay_endpoint"),  # no replay
    ("events", "topic_template"),  # the topic ""
    ("events", "pod"),  # the host name
    ("events", "socket_mode"),  # the control socket's (server.socket_mode)
    ("events", "socket_group"),  # the control socket's (server.socket_group)
    ("metrics", "address"),  # no metrics server
    ("metrics", "socket_group"),  # the group the metrics socket is created with
    ("disk", "path"),  # no disk tier
    ("mooncake", "master"),  # no cluster tier
    ("mooncake", "metadata"),  # the master's host, port 8080
    ("mooncake", "rdma_devices"),  # every device
    ("mooncake", "local_hostname"),  # the host name
    ("mooncake", "key_file"),  # no cluster key: the cluster tier does not open
}
# Lists for which no entry is a documented meaning: "" (from the environment) and [] are ().
EMPTY_LIST_MEANS_NONE = {("tenancy", "shared_groups")}  # no group shares across its users


def _accepted(section: str, key: str, value: object, *, from_env: bool = False) -> bool:
    """Whether ``value`` (a str from the environment or a TOML value) is a valid setting."""
    if (section, key) in EMPTY_LIST_MEANS_NONE:  # a list: blank from the environment, or []
        return value == [] or (from_env and isinstance(value, str) and not value.strip())
    if value == "":
        return (section, key) in EMPTY_MEANS_SOMETHING
    if (section, key) == ("events", "pod"):
        return isinstance(value, str)  # any text names the pod
    if (section, key) == ("events", "topic_template"):
        return isinstance(value, str) and "{" not in value  # literal text is a fine topic
    return False


ENV_VALUES = ["", GARBAGE, " "]
TOML_VALUES = ['""', f'"{GARBAGE}"', "[]"]


@pytest.mark.parametrize(("section", "key"), SETTING_KEYS)
@pytest.mark.parametrize("value", ENV_VALUES, ids=repr)
def test_every_setting_from_the_environment(
    section: str,
    key: str,
    value: str,
    isolated: Path,
    recorder: Recorder,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    variable = f"{ENV_PREFIX}{section.upper()}__{key.upper()}"
    monkeypatch.setenv(variable, value)
    status, out, err = run_cli(["check-config", "--json"], capsys)
    if _accepted(section, key, value, from_env=True):
        assert status == 0, err
        settings = msgspec.json.decode(out, type=Settings)
        expected = () if (section, key) in EMPTY_LIST_MEANS_NONE else value
        assert getattr(getattr(settings, section), key) == expected
    else:
        assert_refused(status, err, f"{section}.{key}", variable)


@pytest.mark.parametrize(("section", "key"), SETTING_KEYS)
@pytest.mark.parametrize("literal", TOML_VALUES)
def test_every_setting_from_toml(
    section: str,
    key: str,
    literal: str,
    isolated: Path,
    recorder: Recorder,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = isolated / "offloadd.toml"
    path.write_text(f"[{section}]\n{key} = {literal}\n")
    value = tomllib.loads(path.read_text())[section][key]
    status, out, err = run_cli(["check-config", "--json", "--config", str(path)], capsys)
    if _accepted(section, key, value):
        assert status == 0, err
        settings = msgspec.json.decode(out, type=Settings)
        expected = () if (section, key) in EMPTY_LIST_MEANS_NONE else value
        assert getattr(getattr(settings, section), key) == expected
    else:
        assert_refused(status, err, f"{section}.{key}", str(path))


def test_serve_reports_a_bad_setting_before_importing_the_daemon(
    isolated: Path, recorder: Recorder, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _out, err = run_cli(["serve", "--events-endpoint", "tcp://127.0.0.1"], capsys)
    assert_refused(status, err, "events.endpoint", "--events-endpoint", "tcp://HOST:PORT")
    assert err.startswith("offloadd: ")


def test_bench_passes_every_only_and_the_results_file(
    isolated: Path, recorder: Recorder, capsys: pytest.CaptureFixture[str]
) -> None:
    results = str(isolated / "results.json")
    argv = ["bench", "--quick", "--only", "shm", "--only", "lookup_rtt_*", "--json", results]
    status, _out, err = run_cli(argv, capsys)
    assert status == 0, err
    args, _kwargs = recorder.last("bench")
    assert args == (["--quick", "--json", results, "--only", "shm", "lookup_rtt_*"],)


def test_bench_passes_smoke_and_refuses_it_with_quick(
    isolated: Path, recorder: Recorder, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _out, err = run_cli(["bench", "--smoke", "--only", "vllm"], capsys)
    assert status == 0, err
    args, _kwargs = recorder.last("bench")
    assert args == (["--smoke", "--only", "vllm"],)
    status, _out, err = run_cli(["bench", "--smoke", "--quick"], capsys)
    assert_refused(status, err, "--smoke", "--quick")


def test_check_gpu_passes_its_options_with_sizes_in_bytes(
    isolated: Path, recorder: Recorder, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _out, err = run_cli(["check-gpu"], capsys)
    assert status == 0, err
    assert recorder.last("check-gpu") == ((offloadd.gpu_check.Options(),), {})
    results = str(isolated / "gpu.json")
    argv = ["check-gpu", "--total", "1GiB", "--page", "18KiB", "--pad", "0", "--arena", "2GiB"]
    argv += ["--latency-jobs", "0", "--contiguous", "--allow-degraded", "--json", results]
    status, _out, err = run_cli(argv, capsys)
    assert status == 0, err
    (options,), _kwargs = recorder.last("check-gpu")
    assert options == offloadd.gpu_check.Options(
        total=1 << 30,
        page=18 << 10,
        pad=0,
        arena=2 << 30,
        latency_jobs=0,
        contiguous=True,
        allow_degraded=True,
        json=results,
    )


def test_check_config_takes_serves_flags_and_names_them_as_sources(
    isolated: Path, recorder: Recorder, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli(["check-config", "--capacity", "2GiB", "--no-persist"], capsys)
    assert status == 0, err
    assert out.splitlines()[0] == (
        "# offloadd settings from: built-in defaults, --capacity, --no-persist"
    )
    assert "capacity = 2147483648  # 2.0GiB" in out.splitlines()
    assert "persist = false" in out.splitlines()


def test_the_help_is_written_for_operators(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["--help"], capsys)
    assert status == 0
    assert "``" not in out and "SETTINGS_FLAGS" not in out  # no RST, no internal names
    assert "offloadd check-config --preflight" in out
    status, out, _ = run_cli(["serve", "--help"], capsys)
    assert status == 0
    text = " ".join(out.split())
    assert "Settings without a flag" in text
    assert "server.copy_engine" in text and "limits.sessions_per_uid" in text
    assert "cache.capacity," not in text  # it has a flag (--capacity)


def test_a_misspelt_flag_points_at_the_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["serve", "--capcity", "8GiB"], capsys)
    assert_refused(status, err, "--capcity")
    assert "did you mean --capacity?" in err
    assert err.strip().endswith("(see offloadd serve --help)")
    status, _, err = run_cli(["status", "--jsn"], capsys)
    assert_refused(status, err, "--jsn")
    assert "did you mean --json?" in err and "(see offloadd status --help)" in err
