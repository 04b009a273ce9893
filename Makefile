# The two set-up commands: `make demo` and `make test`. Both create and use .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install bytecode vllm lint types check test demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,report]'
	touch $(STAMP)

install: $(STAMP)

# The project's bytecode, compiled ahead for every process the tests, the demo and the
# benchmarks start: where PYTHONDONTWRITEBYTECODE is set (CI machines, sandboxes, the
# Dockerfile), each would otherwise compile the whole package again (~0.05 s CPU a process).
# Files already compiled are skipped.
bytecode: $(STAMP)
	$(PY) -m compileall -q replay locustfile.py

# The checks that need no server process, for every edit (docs/testing.md): the linter (ruff,
# pinned), the types (mypy, pinned: replay/run, engine, protocol and rules clean, the rest held
# to tests/mypy-baseline.txt, which only shrinks), and the tests that run in one process (the
# floor plan's layers, the engine on a fake clock, the docs against the code).
CHECK_TESTS ?= tests/test_layout.py tests/test_engine_pipeline.py tests/test_live.py tests/test_docs.py \
	tests/test_mypy_baseline.py

lint: $(STAMP)
	$(PY) -m ruff check .

types: $(STAMP)
	$(PY) tests/support/mypy_baseline.py

check: lint types
	$(PY) -m pytest -q -n 2 $(CHECK_TESTS)

# Real vLLM on CPU for the parity and fidelity tests: its own venv, it pins its own world.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): .ci/install-vllm
	bash .ci/install-vllm $(VLLM_VENV)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The tests mostly wait on real servers and processes, so they run in TEST_JOBS processes
# (pytest-xdist) even on 2 cores; --dist loadgroup keeps each real vLLM server's tests in one
# (tests/conftest.py). TEST_JOBS=0 runs them in one process. The tests marked `alone` have
# wall-clock bounds (drift, stop times, heartbeats) that other tests' CPU load would break: they
# run one at a time and at normal priority, at the same time as the parallel ones, which run
# (with the alone vLLM test's server start) under SCHED_IDLE ($(IDLE)): it gets a core only
# when no normal process wants one, so the alone tests see a quiet machine and the parallel ones
# take the CPU the alone ones leave idle while they wait. The alone tests that keep more than a
# core busy (`heavy`) would leave the parallel ones none: they run after them, with the alone
# vLLM test, whose server is up by then (tests/support/serve_vllm.py). `sync` first: a fresh
# install's files are written out before the alone tests, not while they run. The parallel
# tests' output is shown when they end (exit 5 of an alone pass: none selected).
TEST_JOBS ?= 4
IDLE := $(shell chrt --idle 0 true 2>/dev/null && echo chrt --idle 0 || echo nice -n 19)

test: $(STAMP) $(VLLM_STAMP) bytecode lint types
	sync
	ahead=$$(mktemp); log=$$(mktemp); \
	PYTHONPATH=tests $(IDLE) $(PY) -m support.serve_vllm "$$ahead" & server=$$!; \
	$(IDLE) $(PY) -m pytest -n $(TEST_JOBS) --dist loadgroup -m "not alone" $(PYTEST_ARGS) >"$$log" 2>&1 & parallel=$$!; \
	trap 'kill $$server $$parallel 2>/dev/null; wait $$server; rm -f "$$ahead" "$$log"' EXIT; \
	$(PY) -m pytest -m "alone and not vllm and not heavy" $(PYTEST_ARGS); alone=$$?; \
	wait $$parallel; parallel_rc=$$?; cat "$$log"; \
	TRACEREPLAY_VLLM_SMALL_CACHE_FILE="$$ahead" $(PY) -m pytest -m "alone and (vllm or heavy)" $(PYTEST_ARGS); last=$$?; \
	echo "make test: parallel tests exit $$parallel_rc, alone tests beside them $$alone, alone tests after them $$last"; \
	test $$parallel_rc -eq 0 && { test $$alone -eq 0 || test $$alone -eq 5; } && { test $$last -eq 0 || test $$last -eq 5; }

demo: $(STAMP) bytecode
	$(PY) -m replay.demo

bench: $(STAMP) bytecode
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
