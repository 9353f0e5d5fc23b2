# The two commands of the README. Each creates .venv and installs what is missing, so a fresh
# machine needs nothing but Python 3.11.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test setup lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray,serve]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/edgemoe demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
