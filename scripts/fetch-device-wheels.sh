#!/usr/bin/env bash
# Downloads, into wheels/ (git-ignored), the Python 3.12 x86-64 wheels scripts/device-check.sh
# installs on a GPU machine that can fetch nothing: what offloadd needs that such a machine's
# image may lack or have too old (pyzmq, msgspec, prometheus-client, numpy) and the test tools
# the image lacks (pytest-asyncio, with pytest and what pytest needs in case the image's is
# older than pytest-asyncio wants). Each without its dependencies (named here instead): the
# device installs only those it needs, one version each.
#   scripts/fetch-device-wheels.sh            then carry wheels/ to the device machine
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python
dest=wheels

# The test extra's exact pins for the test tools; the rest at the newest release.
mapfile -t wanted < <("$python" - <<'EOF'
import re
import tomllib

pins = {}
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][
    "test"
]:
    found = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^,;\s]+)", requirement.strip())
    if found:
        pins[found.group(1).lower()] = found.group(2)
for name in ("pyzmq", "msgspec", "prometheus-client", "numpy", "pytest-asyncio", "pytest",
             "pluggy", "iniconfig", "typing-extensions"):
    print(f"{name}=={pins[name]}" if name in pins else name)
EOF
)

mkdir -p "$dest"
platforms=()
# pip matches a manylinux tag exactly: name each glibc level wheels are commonly built for.
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$tag")
done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "fetch-device-wheels: ${wanted[*]} -> $dest/" >&2
if ! "$python" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" "${wanted[@]}" \
    >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
# One version of each: an older download beside a newer one would stop the install there.
"$python" - "$dest" <<'EOF'
import os
import re
import sys

dest = sys.argv[1]
seen = {}
for name in sorted(os.listdir(dest)):
    if name.endswith(".whl"):
        project = re.sub(r"[-_.]+", "-", name.split("-")[0]).lower()
        seen.setdefault(project, []).append(name)
doubled = {project: names for project, names in seen.items() if len(names) > 1}
if doubled:
    sys.exit(f"fetch-device-wheels: several versions in {dest}/, keep one: {doubled}")
EOF
ls -l "$dest" >&2
du -sh "$dest" >&2
