# `make demo` and `make test` do all set-up on a fresh machine (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in two sentences why the sky is blue.

# The README's main command: a quick tuning run of the embedded model that fits a CPU.
TUNE_ARGS ?= --ctx 1k --num-prompts 1 --max-new-tokens 32 --budgets 64,256 --probe-gamma 8 \
	--candidates 2 --max-rounds 3

.PHONY: setup tune demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

# Exit code 3 means the run finished and found no configuration faster than vanilla
# decoding (the profile says recommended: false): a result, not a failure here.
tune: setup
	$(VENV)/bin/vegas-tune $(TUNE_ARGS) || [ $$? -eq 3 ]

demo: setup
	$(VENV)/bin/vegas generate --chat --prompt "$(PROMPT)" --max-new-tokens 64

# Test modules run in parallel workers, one module per worker at a time (its fixtures
# load once); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= auto

test: setup
	bash scripts/setup-test-services.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
