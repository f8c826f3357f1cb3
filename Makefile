.PHONY: demo test serve

# Set-up happens inside each target (scripts/bootstrap.sh), so both work on a fresh machine.
demo:
	scripts/bootstrap.sh
	.venv/bin/offloadd demo

serve:
	scripts/bootstrap.sh
	.venv/bin/offloadd serve

test:
	scripts/test.sh
