#!/usr/bin/env bash
# The whole check: lint, types, tests. Exit status 5 from pytest (nothing collected) is a
# failure here: this project always has tests, so collecting none means something broke.
set -euo pipefail
cd "$(dirname "$0")/.."
# The plugins' tests run against the vLLM and SGLang bootstrap pinned, never skip (tests/vllm,
# tests/sglang). A pin not found would turn that check off: it fails the run instead.
vllm_pin="$(sed -n 's/^vllm_pin=//p' scripts/bootstrap.sh)"
sglang_pin="$(sed -n 's/^sglang_pin=//p' scripts/install-sglang.sh)"
if [ -z "$vllm_pin" ] || [ -z "$sglang_pin" ]; then
    echo "scripts/test.sh: no vllm_pin in bootstrap.sh or sglang_pin in install-sglang.sh" >&2
    exit 1
fi
scripts/bootstrap.sh --system-packages  # the tests' apt packages too (as root)
.venv/bin/ruff check protocol offloadd tests benchmarks
.venv/bin/ruff format --check protocol offloadd tests benchmarks
.venv/bin/mypy
set +e
OFFLOADD_REQUIRE_VLLM="$vllm_pin" OFFLOADD_REQUIRE_SGLANG="$sglang_pin" .venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
