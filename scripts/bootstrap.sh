#!/usr/bin/env bash
# Creates .venv and installs offloadd with its test tools. Safe to run again: it only
# reinstalls when pyproject.toml changed. torch is pinned first so that the CPU wheel on
# this machine is used instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

# The cluster tier's Mooncake Store (the `mooncake` extra) loads these system libraries even
# over TCP: installed with apt-get when running as root (CI), else named.
libraries=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
missing=()
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
    if ! grep -qF "${pair%%:*}" <<<"$libraries"; then
        missing+=("${pair#*:}")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "bootstrap: apt-get install ${missing[*]} (for the mooncake extra)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    else
        echo "bootstrap: the mooncake tests need ${missing[*]}:" \
            "sudo apt-get install ${missing[*]}" >&2
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=.venv/.offloadd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
    || [ scripts/vllm-test-requirements.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,mooncake]'
    # vLLM 0.33 for the plugin tests (offloadd.vllm), without its CUDA stack.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps 'vllm==0.33.0'
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -r scripts/vllm-test-requirements.txt
    touch "$stamp"
fi
