#!/usr/bin/env bash
# The whole check: lint, types, tests. Exit status 5 from pytest (nothing collected) is a
# failure here: this project always has tests, so collecting none means something broke.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh --system-packages  # the tests' apt packages too (as root)
.venv/bin/ruff check protocol offloadd tests benchmarks
.venv/bin/ruff format --check protocol offloadd tests benchmarks
.venv/bin/mypy
set +e
# The plugins' tests run against the vLLM and SGLang bootstrap pinned, never skip (tests/vllm,
# tests/sglang).
OFFLOADD_REQUIRE_VLLM="$(sed -n 's/^vllm_pin=//p' scripts/bootstrap.sh)" \
OFFLOADD_REQUIRE_SGLANG="$(sed -n 's/^sglang_pin=//p' scripts/install-sglang.sh)" \
    .venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
