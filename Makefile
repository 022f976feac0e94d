# `make demo` and `make test` do all set-up on a fresh machine (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup demo test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)

demo: setup
	$(VENV)/bin/vegas generate --chat --prompt "$(PROMPT)" --max-new-tokens 64

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
