# agentfsm: `make test` and `make demo` work on a fresh machine with only Python 3.11+.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo bench lint typecheck pytest quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,lint]"
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check agentfsm tests examples bench
	$(PY) -m ruff format --check agentfsm tests examples bench

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest

test: lint typecheck pytest

quick: $(STAMP)
	$(PY) -m pytest -m "not e2e" -x -q

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) bench/bench_loop.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
