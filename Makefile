# Everything runs from a project-local virtualenv that this Makefile builds itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint format smoke clean

setup: $(STAMP)

# torch is pinned to the CPU build first so that no range below pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	@if $(BIN)/python -c "import triton" 2>/dev/null; then echo "triton must not be installed on the CPU path"; exit 1; fi
	touch $(STAMP)

test: lint
	$(BIN)/python -m pytest -q -x --durations=15

# One style for the whole tree (pyproject.toml [tool.ruff]); `make format` applies it.
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

smoke: $(STAMP)
	$(BIN)/python -m cli smoke --work .smoke

clean:
	rm -rf .smoke .pytest_cache
