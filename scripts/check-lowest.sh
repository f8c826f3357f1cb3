#!/usr/bin/env bash
# Do the lower bounds in pyproject.toml hold? Builds a venv with every runtime dependency at
# exactly its lower bound (pip has no "lowest" resolution: `name>=X` becomes `name==X`), torch
# pinned as scripts/bootstrap.sh pins it, the test tools as the `test` extra pins them, then runs
# the unit tests against it. A bound that fails here is too low: raise it.
#   scripts/check-lowest.sh [pytest arguments]        (LOWEST_VENV=/tmp/lowvenv by default)
#   scripts/check-lowest.sh --pins                    prints the name==lower pins only
# The venv is kept and reused while the computed pins stay the same.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${LOWEST_VENV:-/tmp/lowvenv}
torch_pin=$(sed -n 's/^torch_pin=//p' scripts/bootstrap.sh)

pins=$("$python" - "$torch_pin" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
torch_pin = sys.argv[1]
for requirement in project["dependencies"]:
    name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", requirement.strip()).groups()
    if name == "torch":
        print(f"torch=={torch_pin}")  # the CPU wheel bootstrap installs, not torch's floor
        continue
    lower = [s[2:].strip() for s in spec.split(",") if s.strip().startswith(">=")]
    if not lower:
        sys.exit(f"check-lowest: {requirement!r} has no lower bound (>=) to check")
    print(f"{name}=={lower[0]}")
EOF
)
if [ "${1:-}" = --pins ]; then
    echo "$pins"
    exit 0
fi
tools=$("$python" -c '
import tomllib
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]:
    print(requirement)
')

stamp="$venv/.offloadd-lowest"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$pins"$'\n'"$tools" ]; then
    echo "check-lowest: creating $venv with" $pins >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    log="$venv/install.log"
    pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
    # torch first, alone, so the local CPU wheel is taken (as in bootstrap.sh).
    if ! { "${pip[@]}" "torch==$torch_pin" \
        && "${pip[@]}" $pins \
        && mapfile -t tool_list <<<"$tools" && "${pip[@]}" "${tool_list[@]}" \
        && "${pip[@]}" $pins; } >"$log" 2>&1; then
        cat "$log" >&2
        echo "check-lowest: installing failed (log: $log)" >&2
        exit 1
    fi
    printf '%s\n%s' "$pins" "$tools" >"$stamp"
fi
# Installing the test tools must not have lifted a pin (the last install above re-asserts
# them; a tool that needs more shows here).
names=$(echo $pins | sed 's/==[^ ]*//g; s/[-_]/[-_]/g; s/ /|/g')
"$venv/bin/python" -m pip freeze --disable-pip-version-check 2>/dev/null \
    | grep -iE "^($names)==" | tr '\n' ' ' >&2
echo >&2
# The unit tests of the vLLM plugin are left out: they need vLLM, which bootstrap.sh installs
# without its dependencies (vLLM's own floors for these packages are no higher than ours).
ignored=()
for file in $(grep -l -E "^\s*(from|import) (offloadd\.vllm|vllm)" tests/unit/*.py); do
    ignored+=("--ignore=$file")
done
# The tree under test comes first on the path (tests also find it through pytest's pythonpath).
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q \
    -p no:cacheprovider "${ignored[@]}" tests/unit "$@"
