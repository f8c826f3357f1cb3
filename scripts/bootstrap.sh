#!/usr/bin/env bash
# Creates .venv and installs offloadd with its test tools. Safe to run again: it only
# reinstalls when pyproject.toml or scripts/vllm-test-requirements.txt changed. Each step says
# in one line what it does; what pip and apt-get print goes to .venv/bootstrap.log and is shown
# only when that step fails. torch is pinned first so that the CPU wheel on this machine is
# used instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_pin=2.13.0
vllm_pin=0.33.0
stamp=.venv/.offloadd-installed
log=.venv/bootstrap.log

# step DESCRIPTION COMMAND...: says DESCRIPTION, runs COMMAND with its output appended to $log,
# and on failure prints that output (this step's only) and stops.
step() {
    local what=$1 start
    shift
    echo "bootstrap: $what" >&2
    start=$(($(wc -c <"$log") + 1))
    if ! "$@" >>"$log" 2>&1; then
        tail -c "+$start" "$log" >&2
        echo "bootstrap: failed: $what (all output: $log)" >&2
        exit 1
    fi
}

pip_install() {
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-input "$@"
}
# vLLM for the plugin tests (offloadd.vllm): vllm itself with --no-deps (it pins a CUDA torch),
# then what the tested modules import. pip then reports vLLM's other requirements as missing
# ("ERROR: pip's dependency resolver ..."): expected, and left in the log.
install_vllm() {
    pip_install --no-deps "vllm==$vllm_pin" && pip_install -r scripts/vllm-test-requirements.txt
}

mkdir -p .venv
: >"$log"  # this run's output only

# System packages the tests need, with --system-packages only (scripts/test.sh: `make demo`
# and `make serve` change nothing outside the checkout), installed with apt-get when running
# as root (CI), else named:
# - the cluster tier's Mooncake Store (the `mooncake` extra) loads libibverbs, libnuma and
#   libcurl even over TCP;
# - promtool, for the tests that run it: Debian ships it in the `prometheus` package, which
#   also brings the Prometheus server (enabled as prometheus.service where systemd runs).
libraries=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
missing=()
system_packages=false
if [ "${1:-}" = "--system-packages" ]; then
    system_packages=true
fi
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
    if ! grep -qF "${pair%%:*}" <<<"$libraries"; then
        missing+=("${pair#*:}")
    fi
done
if ! command -v promtool >/dev/null; then
    missing+=(prometheus)
fi
if "$system_packages" && [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        step "apt-get install ${missing[*]}" env DEBIAN_FRONTEND=noninteractive \
            sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"' \
            apt-get "${missing[@]}"
    else
        echo "bootstrap: some tests need ${missing[*]}: sudo apt-get install ${missing[*]}" >&2
    fi
fi

if [ ! -x .venv/bin/python ]; then
    step "creating .venv" "$python" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
    || [ scripts/vllm-test-requirements.txt -nt "$stamp" ] \
    || [ scripts/sglang-test-requirements.txt -nt "$stamp" ]; then
    step "installing torch ${torch_pin%.0} (CPU)" pip_install "torch==$torch_pin"
    step "installing offloadd and test tools" pip_install -e '.[test,mooncake]'
    step "installing vLLM ${vllm_pin%.0} without its CUDA stack" install_vllm
    # SGLang for tests/sglang, the same way (about 20 s): scripts/install-sglang.sh.
    step "installing SGLang 0.5.23 without its CUDA stack" scripts/install-sglang.sh
    touch "$stamp"
fi
