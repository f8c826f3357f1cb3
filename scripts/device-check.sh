#!/usr/bin/env bash
# The GPU checks, for a lent GPU machine that can fetch nothing (Python 3.12 with torch, CUDA
# 13, cuda-bindings, numpy, uvloop, xxhash, pytest and hypothesis already there): installs
# what is missing from the wheels scripts/fetch-device-wheels.sh put in wheels/ (carried
# along, as it is git-ignored), then runs the CUDA path end to end
# (python3 -m offloadd check-gpu) and the tests marked gpu, plus the unit tests that
# hold offloadd's ctypes ABI against the node's cuda-bindings. Every step has a timeout and
# the whole stays under 8 minutes; logs and results go to $OUT (./device-out without it),
# a table of the steps comes last. Exit status: 0 when every step passed.
#   here:  scripts/fetch-device-wheels.sh
#   there: scripts/device-check.sh            (carrying wheels/)
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-device-out}
site=${DEVICE_SITE:-/tmp/offloadd-site}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
started=$SECONDS
deadline=$((started + ${DEVICE_CHECK_SECONDS:-470}))
summary=()
failed=0

# step NAME SECONDS LOG COMMAND...: runs COMMAND under a timeout of SECONDS (less if the
# deadline is nearer), output to $out/LOG and to the terminal; records NAME's status and time.
step() {
    local name=$1 limit=$2 log=$out/$3 begin status left
    shift 3
    left=$((deadline - SECONDS))
    if [ "$left" -lt 10 ]; then
        summary+=("$(printf '%-14s %-8s %5ss' "$name" "no time" 0)")
        failed=1
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s): $*"
    begin=$SECONDS
    # A function of this script runs in a child bash (timeout runs programs only).
    if declare -F "$1" >/dev/null; then
        set -- bash -c '"$@"' step "$@"
    fi
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    case $status in
        0) verdict=ok ;;
        124 | 137) verdict=timeout ;;
        *) verdict="rc=$status" ;;
    esac
    summary+=("$(printf '%-14s %-8s %5ss' "$name" "$verdict" $((SECONDS - begin)))")
    [ "$status" -eq 0 ] || failed=1
    return "$status"
}

environment() {
    uname -a
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    "$python" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__,
        "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
}

# The carried wheels this image needs: offloadd's requirements and pytest-asyncio (the test
# extra's pin), each taken from wheels/ only where the image lacks it or has a version out of
# range, then what those wheels require, likewise. Prints the wheels' paths.
choose_wheels() {
    "$python" - <<'EOF'
import importlib.metadata as metadata
import pathlib
import sys
import tomllib
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

carried = {}
for path in sorted(pathlib.Path("wheels").glob("*.whl")):
    carried[canonicalize_name(path.name.split("-")[0])] = path


def requires(wheel: pathlib.Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    return [Requirement(line.split(":", 1)[1]) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


project = tomllib.load(open("pyproject.toml", "rb"))["project"]
tools = {canonicalize_name(Requirement(r).name): Requirement(r)
         for r in project["optional-dependencies"]["test"]}
todo = [Requirement(r) for r in project["dependencies"]] + [tools["pytest-asyncio"]]
chosen: dict[str, pathlib.Path] = {}
problems = []
while todo:
    requirement = todo.pop(0)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    name = canonicalize_name(requirement.name)
    if name in chosen:
        version = Version(chosen[name].name.split("-")[1])
        if not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement}: carried {chosen[name].name}")
        continue
    try:
        have = Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        have = None
    if have is not None and requirement.specifier.contains(have, prereleases=True):
        continue
    wheel = carried.get(name)
    if wheel is None or not requirement.specifier.contains(
        Version(wheel.name.split("-")[1]), prereleases=True
    ):
        problems.append(f"{requirement}: the image has {have}, wheels/ has "
                        f"{wheel.name if wheel else 'none'}")
        continue
    chosen[name] = wheel
    todo.extend(requires(wheel))
for problem in problems:
    print(f"device-check: cannot satisfy {problem}", file=sys.stderr)
print("\n".join(str(path) for path in chosen.values()))
sys.exit(1 if problems else 0)
EOF
}

install_wheels() {
    local wheels
    wheels=$(choose_wheels) || return 1
    if [ -z "$wheels" ]; then
        echo "the image has everything"
        return 0
    fi
    echo "installing into $site:" $wheels
    # shellcheck disable=SC2086  # one path a word
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" $wheels
}

imports() {
    "$python" -c '
import importlib.metadata as m
for name in ("pyzmq", "msgspec", "numpy", "prometheus-client", "xxhash", "uvloop", "torch",
             "cuda-bindings", "pytest", "pytest-asyncio", "pytest-timeout", "hypothesis"):
    print(f"{name:18} {m.version(name)}")
import zmq, msgspec, numpy, prometheus_client, xxhash, uvloop, torch, cuda.bindings.driver
import offloadd
print("offloadd imports from", offloadd.__file__)
'
}

# Plugins named, not auto-loaded: the image has others (benchmark, cov, xdist) that a carried
# pytest need not agree with, and the suite turns every warning into an error.
pytest_run() {
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$python" -m pytest -q -p no:cacheprovider \
        -p pytest_asyncio.plugin -p pytest_timeout -p hypothesis.extra.pytestplugin "$@"
}

export python site
export -f environment choose_wheels install_wheels imports pytest_run
step environment 45 environment.txt environment
if step wheels 60 wheels.log install_wheels; then
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    step imports 45 environment.txt imports
    # Within about a minute on an H200; its own budget is --timeout.
    step check-gpu 240 gpu_check.log "$python" -m offloadd check-gpu --timeout 200 \
        --json "$out/gpu_check.json"
    step "pytest -m gpu" 150 pytest.log pytest_run -m gpu --junitxml="$out/pytest-gpu.xml" tests
    step "pytest cuda" 60 pytest.log pytest_run tests/unit/test_cuda_batch.py \
        tests/unit/test_cuda_pure.py
fi

{
    echo
    printf '%-14s %-8s %6s\n' step result time
    printf '%s\n' "${summary[@]}"
    echo "total $((SECONDS - started))s; logs in $out/"
} | tee "$out/summary.txt"
exit "$failed"
