"""scripts/test.sh (what CI runs) hands the vLLM and SGLang pins to the plugin suites, which
then fail on any other version instead of skipping; a pin it cannot read must fail the run,
not turn that check off. Run on a copy of the scripts whose bootstrap only leaves a mark."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp_path: Path, *, drop: str = "") -> Path:
    """scripts/test.sh and the two pin files; ``drop``: a pin line left out."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", scripts / "test.sh")
    for name, pin in (("bootstrap.sh", "vllm_pin"), ("install-sglang.sh", "sglang_pin")):
        text = (ROOT / "scripts" / name).read_text()
        line = re.search(rf"^{pin}=.*$", text, re.M)
        assert line, f"scripts/{name} has no {pin}= line"
        kept = "" if pin == drop else line.group(0)
        marker = 'touch "$(dirname "$0")/../bootstrapped"; exit 3' if name == "bootstrap.sh" else ""
        (scripts / name).write_text(f"#!/usr/bin/env bash\n{kept}\n{marker}\n")
        (scripts / name).chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("drop", ["vllm_pin", "sglang_pin"])
def test_a_pin_test_sh_cannot_read_fails_the_run_before_anything_runs(
    tmp_path: Path, drop: str
) -> None:
    repo = _checkout(tmp_path, drop=drop)
    done = subprocess.run(["bash", "scripts/test.sh"], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 1
    assert "no vllm_pin in bootstrap.sh or sglang_pin" in done.stderr
    assert not (repo / "bootstrapped").exists()


def test_with_both_pins_test_sh_goes_on_to_the_bootstrap(tmp_path: Path) -> None:
    repo = _checkout(tmp_path)
    done = subprocess.run(["bash", "scripts/test.sh"], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 3  # the stand-in bootstrap's own status: it ran
    assert (repo / "bootstrapped").exists()
