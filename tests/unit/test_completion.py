"""``offloadd completion bash|zsh``: the scripts name what the parser has, the shells accept
them, and the bash function completes what is typed (run in a real bash, no terminal).

The parser is walked here independently of ``offloadd.completion``, so a flag the generator
missed fails the test.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd import cli

TIMEOUT = 30


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _script(shell: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["completion", shell]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out


@pytest.fixture
def bash_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    script = tmp_path / "offloadd.bash"
    script.write_text(_script("bash", capsys))
    return script


def _complete(script: Path, *words: str) -> list[str]:
    """COMPREPLY of the completion function for the command line ``words`` (the last one
    being the word under the cursor), in a fresh non-interactive bash."""
    program = (
        f"source {shlex.quote(str(script))}\n"
        f"COMP_WORDS=({' '.join(shlex.quote(word) for word in words)})\n"
        f"COMP_CWORD={len(words) - 1}\n"
        "_offloadd\n"
        "printf '%s\\n' \"${COMPREPLY[@]}\"\n"
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    assert done.stderr == ""
    return done.stdout.split()


def test_the_bash_script_names_every_command_and_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    words = set(_script("bash", capsys).replace("'", " ").split())
    parsers = list(_parsers(cli.build_parser()))
    assert {path[-1] for path, _ in parsers if path} >= {"serve", "cache", "ls", "clear"}
    for path, parser in parsers:
        assert not path or path[-1] in words
        flags = {flag for action in parser._actions for flag in action.option_strings}
        assert flags - words == set(), f"offloadd {' '.join(path)}: flags missing"


def test_bash_accepts_the_script(bash_script: Path) -> None:
    subprocess.run(["bash", "-n", str(bash_script)], check=True, timeout=TIMEOUT)


def test_zsh_accepts_the_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "_offloadd"
    script.write_text(_script("zsh", capsys))
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed here: only bash's script is parsed")
    subprocess.run(["zsh", "-n", str(script)], check=True, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (("offloadd", "ca"), ["cache"]),
        (("offloadd", "check-"), ["check-config", "check-gpu"]),
        (("offloadd", "cache", "cl"), ["clear"]),
        (("offloadd", "serve", "--ca"), ["--capacity"]),
        (("offloadd", "cache", "clear", "--e"), ["--engine", "--endpoint"]),
        (("offloadd", "completion", ""), ["bash", "zsh"]),
        (("offloadd", "demo", "--phase", "l"), ["load"]),
        (("offloadd", "demo", "--phase", "=", "st"), ["store"]),  # bash splits at '='
        (("offloadd", "demo", "--phase=st"), ["--phase=store"]),
        # A flag's value is not taken for a command, though it is spelt like one.
        (("offloadd", "status", "--endpoint", "cache", ""), []),
        (("offloadd", "status", "--endpoint", "cache", "--j"), ["--json"]),
        (("offloadd", "serve", "--config", ""), []),  # a file name: bash's default
    ],
)
def test_bash_completes_what_is_typed(
    bash_script: Path, words: tuple[str, ...], expected: list[str]
) -> None:
    assert _complete(bash_script, *words) == expected


def test_an_unknown_shell_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["completion", "fish"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
