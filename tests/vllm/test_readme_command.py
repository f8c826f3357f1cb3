"""The README's ``vllm serve`` command works as pasted: vLLM 0.33 parses its config, and the
endpoint it names is the one the daemon under the README's systemd unit listens on."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig

from offloadd import endpoint
from offloadd.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]


def readme_transfer_config() -> str:
    text = (ROOT / "README.md").read_text()
    command = re.search(r"^vllm serve .*?\}\}'$", text, re.MULTILINE | re.DOTALL)
    assert command, "README has no vllm serve command"
    words = shlex.split(command.group(0).replace("\n", " "))
    return words[words.index("--kv-transfer-config") + 1]


def test_vllm_parses_the_readme_config() -> None:
    config = KVTransferConfig(**json.loads(readme_transfer_config()))
    assert config.kv_connector == "OffloadingConnector"
    extra = config.kv_connector_extra_config
    assert extra["spec_name"] == "OffloaddSpec"
    assert extra["spec_module_path"] == "offloadd.vllm"


def test_the_readme_endpoint_is_the_daemons_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    extra = json.loads(readme_transfer_config())["kv_connector_extra_config"]
    # The unit's RuntimeDirectory=offloadd, as systemd hands it to the daemon.
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/offloadd")
    assert load_settings(environ={}).endpoint() == extra["offloadd_endpoint"]


def test_the_plugin_finds_the_node_daemon_without_an_endpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    node = tmp_path / "run-offloadd"
    node.mkdir()
    monkeypatch.setattr(endpoint, "NODE_RUNTIME_DIR", str(node))
    # vLLM itself may run under a unit of its own: its RUNTIME_DIRECTORY is not the daemon's.
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "vllm-service"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    expected = f"ipc://{node}/offloadd.sock"
    assert endpoint.default_endpoint(service=False) == expected
    # The daemon run by hand (no systemd) picks the same directory.
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    assert load_settings(environ={}).endpoint() == expected
