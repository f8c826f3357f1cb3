.PHONY: demo test serve mutate dist settings-doc perf

# Set-up happens inside each target (scripts/bootstrap.sh), so both work on a fresh machine.
demo:
	scripts/bootstrap.sh
	.venv/bin/offloadd demo

serve:
	scripts/bootstrap.sh
	.venv/bin/offloadd serve

test:
	scripts/test.sh

# The wheel to install on a node (`pip install dist/offloadd-*.whl`, into the venv that
# systemd/offloadd.service runs), built without its dependencies, which pip resolves there,
# and the sdist beside it. Needs only a Python with pip and setuptools >= 77 (the .venv when
# there is one); no set-up.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
dist:
	rm -rf dist
	$(PYTHON) -m pip wheel --disable-pip-version-check --quiet --no-deps -w dist .
	$(PYTHON) -c 'from setuptools import build_meta; build_meta.build_sdist("dist")' >/dev/null
	rm -rf build offloadd.egg-info
	@ls dist/*.whl dist/*.tar.gz

# docs/settings.md from the settings schema (tests/unit/test_settings_doc.py fails until rerun).
settings-doc:
	$(PYTHON) -m offloadd.settings_doc

# Mutation testing of the pure core (cache index, policies, allocator, registry, config) with
# their unit tests; mutmut's settings are in setup.cfg. One module at a time keeps a run short:
#   make mutate MUTANTS='offloadd.cache.policy.*'
# Property tests draw fewer, derandomized examples here (tests/strategies.py).
MUTANTS ?=
mutate:
	scripts/bootstrap.sh
	.venv/bin/python -c 'import mutmut' 2>/dev/null || .venv/bin/pip install --quiet 'mutmut==3.8.*'
	OFFLOADD_MUTATE=1 .venv/bin/mutmut run $(MUTANTS)
	.venv/bin/mutmut results

# docs/performance.md's table of the last run, from one quick run of both benchmarks (about
# 12 minutes here); the JSON it renders stays in docs/bench/ (a test holds the table to it).
perf:
	scripts/bootstrap.sh
	.venv/bin/offloadd bench --quick --json docs/bench/offloadd-bench.json
	.venv/bin/python -m benchmarks --quick --json docs/bench/benchmarks.json
	.venv/bin/python -m offloadd.bench.report docs/bench/offloadd-bench.json \
		docs/bench/benchmarks.json --into docs/performance.md
