#!/usr/bin/env bash
# Installs SGLang 0.5.23 into .venv for tests/sglang (which skip without it): the wheel with
# --no-deps, then scripts/sglang-test-requirements.txt, every step under a constraint that
# keeps the CPU torch bootstrap.sh pinned (any torch-related install otherwise pulls CUDA
# torch). Run scripts/bootstrap.sh first (it runs this one too): see docs/sglang.md.
set -euo pipefail
cd "$(dirname "$0")/.."
sglang_pin=0.5.23
torch_pin="$(sed -n 's/^torch_pin=//p' scripts/bootstrap.sh)"
if [ ! -x .venv/bin/python ]; then
    echo "install-sglang: no .venv: run scripts/bootstrap.sh first" >&2
    exit 1
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_pin" >"$constraints"
pip_install() {
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-input \
        -c "$constraints" "$@"
}
echo "install-sglang: sglang $sglang_pin without its CUDA stack" >&2
pip_install --no-deps "sglang==$sglang_pin"
# pip then reports SGLang's other requirements as missing ("dependency resolver"): expected,
# so its output is shown only when the install fails.
echo "install-sglang: what SGLang's HiCache modules import" >&2
if ! log=$(pip_install -r scripts/sglang-test-requirements.txt 2>&1); then
    echo "$log" >&2
    exit 1
fi
.venv/bin/python -c "import sglang, torch; assert torch.__version__.startswith(\"$torch_pin\")"
echo "install-sglang: done" >&2
