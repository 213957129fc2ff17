# kvpool developer commands. `make demo` and `make test` work on a fresh Debian 12 machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv build-deps demo test test-deps proto lint typecheck bench clean

$(VENV)/.installed: pyproject.toml setup.py src/kvpool/transfer/_lanes.c src/kvpool/master/_index.c src/kvpool/transfer/_verbs.c
	bash scripts/install-build-deps.sh
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

build-deps:           ## gcc, Python headers, libxxhash-dev: what the compiled modules need (root for apt-get)
	bash scripts/install-build-deps.sh

demo: venv            ## a local cluster + an agent workload: pool vs private-cache hit rate, GB/s
	$(VENV)/bin/kvpool demo

test-deps: venv       ## etcd, pyverbs, helm and validators (needs root for apt-get)
	bash scripts/install-test-deps.sh

test: test-deps       ## lint, types, then the whole suite (unit, integration with real processes and real etcd, chaos)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -n 2 --durations=15 $(PYTEST_ARGS)

proto: venv           ## regenerate the protobuf/gRPC stubs from src/kvpool/proto/*.proto
	$(PY) -m grpc_tools.protoc -Isrc --python_out=src --pyi_out=src --grpc_python_out=src src/kvpool/proto/master.proto
	$(PY) -m grpc_tools.protoc -Isrc --python_out=src --pyi_out=src --grpc_python_out=src src/kvpool/proto/etcd/*.proto

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: venv
	$(VENV)/bin/mypy

bench: venv           ## transfer benchmark against the TCP ceiling
	$(VENV)/bin/kvpool bench transfer

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
