# gpuslice developer entry points. `make demo` and `make test` create .venv/ when it is missing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

.PHONY: all setup demo inventory chart test lint typecheck imports proto proto-check unit clean \
	kube-binaries cluster-up cluster-down cluster-status

all: test

$(VENV)/.synced: pyproject.toml uv.lock $(wildcard libs/*/pyproject.toml services/*/pyproject.toml)
	bash hack/bootstrap.sh
	touch $@

setup: $(VENV)/.synced

# The embedded default: a real control plane with two fake-GPU nodes running gpuslice.
demo: setup
	$(PY) -m e2e.sandbox.demo

# What gpuslice sees on a node, through the same NVML interface the services use.
inventory: setup
	$(PY) -m gpuslice_nvml.inventory --nvml=fake --fake-nvml-config e2e/fixtures/sample-node.yaml

test: lint typecheck imports proto-check unit

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy .
	for tests in services/*/tests; do \
	  $(BIN)/mypy $$(find $$tests -name '*.py') || exit 1; \
	done

imports: setup
	$(PY) hack/check_imports.py

proto: setup
	$(PY) hack/gen_protos.py

proto-check: setup
	$(PY) hack/gen_protos.py --check

unit: setup kube-binaries
	$(BIN)/pytest -q

# The Helm chart: lint, render for 1.34-1.37, every object judged by the sandbox's API server.
chart: setup kube-binaries
	bash hack/install-helm.sh >/dev/null
	.tools/bin/helm lint --strict charts/gpuslice
	$(BIN)/pytest -q e2e/tests/test_chart.py

# The sandbox's Kubernetes binaries, built once from their Go modules into ~/.cache/gpuslice/kube.
kube-binaries:
	bash hack/kube-binaries.sh

cluster-up: setup kube-binaries
	$(PY) -m e2e.sandbox.controlplane up

cluster-down: setup
	$(PY) -m e2e.sandbox.controlplane down

cluster-status: setup
	$(PY) -m e2e.sandbox.controlplane status

clean:
	rm -rf $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache
