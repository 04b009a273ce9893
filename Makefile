# The two set-up commands: `make demo` and `make test`. Both create and use .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install bytecode vllm test demo bench clean

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

# Real vLLM on CPU for the parity and fidelity tests: its own venv, it pins its own world.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): .ci/install-vllm
	bash .ci/install-vllm $(VLLM_VENV)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The tests mostly wait on real servers and processes, so they run in TEST_JOBS processes
# (pytest-xdist) even on 2 cores; --dist loadgroup keeps each real vLLM server's tests in one
# (tests/conftest.py). TEST_JOBS=0 runs them in this process. The tests marked `alone` run
# after, by themselves: the others' CPU load would break their wall-clock bounds (exit 5: none selected).
# The alone tests' vLLM starts meanwhile, at nice 19 (tests/support/serve_vllm.py): its start
# yields to the parallel tests instead of taking the alone tests' time. The trap stops it
# however the recipe ends.
TEST_JOBS ?= 4

test: $(STAMP) $(VLLM_STAMP) bytecode
	$(PY) -m ruff check .
	ahead=$$(mktemp); \
	PYTHONPATH=tests nice -n 19 $(PY) -m support.serve_vllm "$$ahead" & server=$$!; \
	trap 'kill $$server 2>/dev/null; wait $$server; rm -f "$$ahead"' EXIT; \
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadgroup -m "not alone" $(PYTEST_ARGS) && \
	{ TRACEREPLAY_VLLM_SMALL_CACHE_FILE="$$ahead" $(PY) -m pytest -m alone $(PYTEST_ARGS) || test $$? -eq 5; }

demo: $(STAMP) bytecode
	$(PY) -m replay.demo

bench: $(STAMP) bytecode
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
