# Two commands do all the set-up on a fresh machine:
#   make serve   run tierd on its embedded default (./tierd-data, 127.0.0.1:8470)
#   make test    run the test suite
# Both create .venv and install the project (with its server and test extras) when
# pyproject.toml changes. The base install is the client alone (tierd_client: httpx, numpy).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test lint gpu-test bench

$(BIN)/tierd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[server,test]'
	touch $@

serve: $(BIN)/tierd
	$(BIN)/tierd serve $(ARGS)

test: $(BIN)/tierd
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(BIN)/tierd
	$(BIN)/ruff check app tiering tierd_client tests migrations
	$(BIN)/ruff format --check app tiering tierd_client tests migrations
	$(BIN)/mypy

gpu-test: $(BIN)/tierd
	$(BIN)/python -m pytest -q -m gpu $(ARGS)

bench: $(BIN)/tierd
	$(BIN)/tierd bench $(ARGS)
