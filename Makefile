.PHONY: demo test serve mutate

# Set-up happens inside each target (scripts/bootstrap.sh), so both work on a fresh machine.
demo:
	scripts/bootstrap.sh
	.venv/bin/offloadd demo

serve:
	scripts/bootstrap.sh
	.venv/bin/offloadd serve

test:
	scripts/test.sh

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
