#!/usr/bin/env bash
# Creates .venv and installs offloadd with its test tools. Safe to run again: it only
# reinstalls when pyproject.toml changed. torch is pinned first so that the CPU wheel on
# this machine is used instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=.venv/.offloadd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
    || [ scripts/vllm-test-requirements.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
    # vLLM 0.33 for the plugin tests (offloadd.vllm), without its CUDA stack.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps 'vllm==0.33.0'
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -r scripts/vllm-test-requirements.txt
    touch "$stamp"
fi
