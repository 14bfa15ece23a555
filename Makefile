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
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m experiments.benchmark experiment=demo

test: setup
	$(PY) -m pytest -m "not slow" -q

test-all: setup
	$(PY) -m pytest -q

# ruff (pyproject.toml [tool.ruff]); the fast tests run the same two checks (tests/test_lint.py).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) outputs multirun .cache wandb
