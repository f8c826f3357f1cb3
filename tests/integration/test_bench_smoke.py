"""``offloadd bench --smoke`` and ``python -m benchmarks --smoke``: every benchmark group of
both runs, at a tiny size, or says why not.

The benchmarks are not part of ``pytest`` otherwise, and a group broken by a change to the
daemon (a new bound, a new rule for Hellos) used to stay broken until someone ran the whole
bench. The first test runs each command as a user does, in a subprocess from this checkout
(``offloadd bench``: what a node runs, shipped in the wheel; ``python -m benchmarks``: the
development benchmarks that drive vLLM's scheduler and workers through ``tests/vllm``'s
harness, and SGLang's HiCache batch, from a checkout), and reads the line it prints per
group on stderr (``smoke: <group>: ran N rows in Ts``, or ``skipped in Ts: why``, or
``FAILED in Ts: why``) and the rows it writes to ``--json``. Where vLLM is installed, the
groups that need it (``vllm``, ``vllm_step``, ``vllm_trace``, ``shared_cache``) must run, not
skip; where SGLang is, ``sglang`` must; where mooncake is, the cluster tier's group must.
The two take about 105 s in all on the two-core VM shared with other work (45 and 60 s),
most of it importing vLLM and SGLang (once in each) and starting and stopping daemons and
mooncake clients. The other tests check the verdicts on stand-in groups (a failure is
named, a silent empty group is one), ``--help``, and that the command line imports no
benchmark to start.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import benchmarks
import offloadd.bench
from offloadd import cli
from offloadd.bench import GROUPS, Group
from offloadd.bench._util import Context, Result
from tests.mooncake_master import mooncake_problem

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^smoke: (?P<group>\w+): (?P<status>ran|skipped|FAILED) (?P<rest>.*)$")
NEEDS_VLLM = {"vllm", "vllm_step", "vllm_trace", "shared_cache"}
NEEDS_SGLANG = {"sglang"}
# Each smoke: the command (after ``python``) and the groups it runs.
SMOKES = {
    "offloadd bench": (["-m", "offloadd", "bench"], GROUPS),
    "python -m benchmarks": (["-m", "benchmarks"], benchmarks.GROUPS),
}


def _must_run(groups: Sequence[Group]) -> set[str]:
    """The groups that may not skip here: everything they need is installed."""
    must = {g.name for g in groups} - NEEDS_VLLM - NEEDS_SGLANG - {"mooncake"}
    if importlib.util.find_spec("vllm") is not None:
        must |= NEEDS_VLLM
    if importlib.util.find_spec("sglang") is not None:
        must |= NEEDS_SGLANG
    if not mooncake_problem():
        must.add("mooncake")
    return must


def test_the_two_smokes_cover_distinct_groups() -> None:
    names = [g.name for g in GROUPS] + [g.name for g in benchmarks.GROUPS]
    assert len(names) == len(set(names))
    assert {"vllm_step", "vllm_trace", "shared_cache", "sglang"} == {
        g.name for g in benchmarks.GROUPS
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("smoke", list(SMOKES))
def test_every_group_runs_at_a_tiny_size_or_says_why_it_skipped(smoke: str, tmp_path: Path) -> None:
    command, groups = SMOKES[smoke]
    results = tmp_path / "smoke.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    done = subprocess.run(
        [sys.executable, *command, "--smoke", "--json", str(results)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    tail = done.stderr[-6000:]
    lines = [m for m in map(LINE.match, done.stderr.splitlines()) if m]
    assert done.returncode == 0, tail
    assert [m["group"] for m in lines] == [g.name for g in groups], tail

    rows = [r["name"] for r in json.loads(results.read_text())]
    for group, match in zip(groups, lines, strict=True):
        status, rest = match["status"], match["rest"]
        mine = [n for n in rows if any(fnmatch.fnmatchcase(n, p) for p in group.patterns)]
        if status == "ran":
            assert rest.startswith(f"{len(mine)} rows "), (match.group(0), mine)
            assert mine, match.group(0)
        else:
            assert status == "skipped" and not mine, match.group(0)
            assert re.search(r"in [\d.]+s: \S", rest), f"no reason given: {match.group(0)}"
        if group.name in _must_run(groups):
            assert status == "ran" and "skipped" not in rest, match.group(0)
    claimed = [
        n for n in rows if any(fnmatch.fnmatchcase(n, p) for g in groups for p in g.patterns)
    ]
    assert claimed == rows


def _group(name: str, run: Callable[[Context], list[Result]]) -> Group:
    return Group(name, (f"{name}_*",), run, "a stand-in")


def test_a_group_that_fails_or_runs_nothing_silently_fails_the_smoke_by_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def row(name: str, value: float = 1.0) -> Result:
        return Result(name, value, "x", 1.0, value)

    def raises(ctx: Context) -> list[Result]:
        raise RuntimeError("TOO_LARGE")

    def skips(ctx: Context) -> list[Result]:
        ctx.skip("skips", "nothing to run it on")
        return []

    groups = (
        _group("good", lambda ctx: [row("good_a"), row("good_b")]),
        _group("skips", skips),
        _group("raises", raises),
        _group("silent", lambda ctx: []),
        _group("nan", lambda ctx: [row("nan_a", math.nan)]),
    )
    monkeypatch.setattr(offloadd.bench, "GROUPS", groups)
    assert offloadd.bench.main(["--smoke"]) == 1
    err = capsys.readouterr().err
    verdicts = {
        m["group"]: (m["status"], m["rest"]) for m in map(LINE.match, err.splitlines()) if m
    }
    assert verdicts["good"][0] == "ran" and verdicts["good"][1].startswith("2 rows ")
    assert (
        verdicts["skips"][0] == "skipped" and "skips: nothing to run it on" in verdicts["skips"][1]
    )
    assert verdicts["raises"][0] == "FAILED" and "TOO_LARGE" in verdicts["raises"][1]
    assert verdicts["silent"][0] == "FAILED" and "no reason" in verdicts["silent"][1]
    assert verdicts["nan"][0] == "FAILED" and "nan_a" in verdicts["nan"][1]
    assert "failed groups: raises, silent, nan" in err
    # Outside --smoke, a group that ran nothing is no failure (--only may have left it out).
    monkeypatch.setattr(offloadd.bench, "GROUPS", groups[:2] + groups[3:])
    assert offloadd.bench.main([]) == 0
    # The runner takes another set of groups (python -m benchmarks gives its own).
    assert offloadd.bench.main(["--smoke", "--only", "raises"], groups=groups) == 1
    assert "smoke: raises: FAILED" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        offloadd.bench.main(["--only", "good"], groups=groups[1:])  # not among those


def test_bench_help_lists_every_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--smoke" in out
    listed = out.split("groups (for --only):", 1)[1].split()
    for group in GROUPS:
        assert group.name in listed
    assert "python -m benchmarks" in out  # where the development benchmarks went
    for group in benchmarks.GROUPS:
        assert group.name not in listed


def test_benchmarks_help_lists_its_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        benchmarks.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m benchmarks") and "--smoke" in out
    listed = out.split("groups (for --only):", 1)[1].split()
    wanted = NEEDS_VLLM | NEEDS_SGLANG
    assert [g.name for g in benchmarks.GROUPS] == [n for n in listed if n in wanted]


def test_the_command_line_imports_no_benchmark_to_start() -> None:
    """The bench's groups are listed when --help is printed, not when ``offloadd`` starts:
    importing them would cost every other command, a daemon that dropped its privileges
    included. Neither check-gpu nor the checkout's packages are imported either."""
    code = (
        "import sys; from offloadd import cli; cli.build_parser();"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('tests', 'benchmarks')"
        " or m.startswith(('offloadd.bench', 'offloadd.gpu_check'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"
