"""``offloadd install``'s plan without running it: the users it would create (as root), the
unit it writes, the ``vllm serve`` line it prints, and who may run it."""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex
import zipfile
from pathlib import Path

import pytest

from offloadd import install
from offloadd.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def wheel(tmp_path: Path) -> Path:
    path = tmp_path / "offloadd-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("offloadd/__init__.py", "")
    return path


def test_the_shipped_files_are_the_checkouts_systemd_files() -> None:
    for name in ("offloadd.service", "offloadd.toml"):
        assert install.shipped(name) == (REPO / "systemd" / name).read_text()


def test_the_unit_names_the_prefix_only_with_one(wheel: Path, tmp_path: Path) -> None:
    assert install.unit_text(install.Options(wheel)) == install.shipped("offloadd.service")
    text = install.unit_text(install.Options(wheel, prefix=tmp_path))
    venv, config = tmp_path / "opt/offloadd/venv", tmp_path / "etc/offloadd/offloadd.toml"
    assert f"\nExecStart={venv}/bin/offloadd serve --config {config}\n" in text
    assert " /opt/offloadd" not in text and "=/opt/offloadd" not in text


def test_missing_users_are_created_and_clients_added(
    wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(name: str) -> None:
        raise KeyError(name)

    monkeypatch.setattr("grp.getgrnam", missing)
    monkeypatch.setattr("pwd.getpwnam", missing)
    ran: list[list[str]] = []
    monkeypatch.setattr(install, "_run", ran.append)
    options = install.Options(wheel, prefix=tmp_path, create_users=True, clients=("vllm",))
    steps = install.plan(options)
    for step in steps[:3]:
        assert step.action is not None
        step.action()
    assert ran == [
        ["groupadd", "--system", "offloadd-clients"],
        ["useradd", "--system", "--gid", "offloadd-clients", "--no-create-home", "--home-dir",
         "/nonexistent", "--shell", "/usr/sbin/nologin", "offloadd"],
        ["usermod", "-aG", "offloadd-clients", "vllm"],
    ]  # fmt: skip
    # With --prefix and without --create-users: no user, group or membership at all.
    changes = [step.change for step in install.plan(install.Options(wheel, tmp_path))]
    assert not [c for c in changes if c.startswith(("create system", "add user"))], changes


def test_the_vllm_line_is_the_readmes_with_the_nodes_endpoint() -> None:
    line = install.vllm_serve_line("ipc:///run/offloadd/offloadd.sock")
    words = shlex.split(line)
    assert words[:3] == ["vllm", "serve", "MODEL"]
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert config["kv_load_failure_policy"] == "recompute"
    extra = config["kv_connector_extra_config"]
    assert extra["offloadd_endpoint"] == "ipc:///run/offloadd/offloadd.sock"
    assert extra["spec_module_path"] == "offloadd.vllm"


def test_the_vllm_line_printed_for_a_default_node_is_the_readmes() -> None:
    readme = (REPO / "README.md").read_text()
    command = re.search(r"vllm serve MODEL --kv-transfer-config '(.*?)'", readme, re.DOTALL)
    assert command, "README's vllm serve line"
    printed = shlex.split(install.vllm_serve_line(install.NODE_ENDPOINT))[-1]
    assert json.loads(printed) == json.loads(command[1])


def test_the_endpoint_printed_is_the_settings_files(wheel: Path, tmp_path: Path) -> None:
    options = install.Options(wheel, prefix=tmp_path)
    assert install.node_endpoint(options) == "ipc:///run/offloadd/offloadd.sock"
    config = options.path(install.CONFIG)
    config.parent.mkdir(parents=True)
    config.write_text('[server]\nendpoint = "ipc:///run/od/od.sock"\n')
    assert install.node_endpoint(options) == "ipc:///run/od/od.sock"


def test_dry_run_lists_every_step_and_changes_nothing(wheel: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    prefix = tmp_path / "root"
    assert install.main(install.Options(wheel, prefix=prefix, dry_run=True), out) == 0
    assert not prefix.exists()
    text = out.getvalue()
    assert text.count("\n  would   ") == 3
    assert "3 changes to make; nothing was changed" in text
    assert f"systemctl link {prefix}/etc/systemd/system/offloadd.service" in text


def _args(wheel: Path, **changes: object) -> argparse.Namespace:
    defaults: dict[str, object] = dict(
        wheel=str(wheel), prefix=None, dry_run=False, create_users=False, client=[],
        python="python3", no_deps=False, pip_arg=[],
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **changes})


def test_only_root_installs_on_the_node(
    wheel: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert install.run_command(_args(wheel)) == install.FAILED
    assert "run it as root" in capsys.readouterr().err
    assert install.run_command(_args(wheel, prefix="/x", client=["vllm"])) == install.BAD_USAGE
    assert "--client adds to a group it manages" in capsys.readouterr().err


def test_the_command_line_has_install() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["install", "--help"])
    assert exited.value.code == 0
