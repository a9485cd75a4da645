# gpuslice developer entry points. `make demo` and `make test` create .venv/ when it is missing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

.PHONY: all setup demo inventory chart chart-readme test lint actionlint release-local typecheck imports proto proto-check unit clean \
	kube-binaries node-binaries hook-binary images e2e-real e2e-kind cluster-up cluster-down \
	cluster-status gpu-stage start-stress nvml-mock

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

# Everything CI runs. hack/test.sh runs the real-node tier (e2e/tests/realnode) as a pytest
# session of its own alongside lint, typecheck, imports, proto-check and the other tests
# (GPUSLICE_TEST_SERIAL=1: one after the other); `make unit` is the single serial session.
test: setup kube-binaries node-binaries hook-binary images nvml-mock
	bash hack/test.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	bash hack/actionlint.sh

# The GitHub workflows checked by actionlint, built once from its Go module (hack/actionlint.sh).
actionlint:
	bash hack/actionlint.sh

typecheck: setup
	$(BIN)/mypy .
	for tests in services/*/tests tools/*/tests; do \
	  $(BIN)/mypy $$(find $$tests -name '*.py') || exit 1; \
	done

imports: setup
	$(PY) hack/check_imports.py

proto: setup
	$(PY) hack/gen_protos.py

proto-check: setup
	$(PY) hack/gen_protos.py --check

unit: setup kube-binaries node-binaries hook-binary images nvml-mock
	$(BIN)/pytest -q --durations=25

# The mock libnvidia-ml.so.1 on the fake node (docs/nvml-mock.md), built with gcc into
# ~/.cache/gpuslice/nvml-mock; the tests build it on demand too. Prints the library's directory.
nvml-mock:
	bash hack/nvml-mock.sh

# Every service started STARTS times under a CPU load the way the e2e suite starts it, stopped
# with SIGTERM; counts the starts that abort (issue 27). Table on stdout (docs/sandbox.md).
STARTS ?= 200
start-stress: setup kube-binaries
	$(PY) hack/start_stress.py --starts $(STARTS)

# The Helm chart: lint, render for 1.34-1.37, every object judged by the sandbox's API server;
# examples/: every spec dry-run against that API server, the chart rendered with every values file.
chart: setup kube-binaries
	bash hack/install-helm.sh >/dev/null
	.tools/bin/helm lint --strict charts/gpuslice
	$(PY) hack/chart_readme.py --check
	$(BIN)/pytest -q e2e/tests/chart/test_chart.py e2e/tests/chart/test_examples.py

# The values table of charts/gpuslice/README.md, regenerated from values.yaml's `# --` comments.
chart-readme:
	$(PY) hack/chart_readme.py

# The sandbox's Kubernetes binaries, built once from their Go modules into ~/.cache/gpuslice/kube.
kube-binaries:
	bash hack/kube-binaries.sh

# The user scenarios on real kubelets with the chart installed from our images (tier 4), and
# the same scenarios in kind where Docker exists (tier 5; here it says why it cannot run).
e2e-real: setup kube-binaries node-binaries images
	$(BIN)/pytest -q e2e/tests/realnode

e2e-kind: setup
	bash hack/e2e-kind.sh

# The enforcer's limits measured on one real GPU, no Kubernetes (docs/gpu-stage.md); as root.
# Shared machines: make gpu-stage GPU_STAGE_ARGS=--keep-gpu-settings. Without a GPU:
# GPU_STAGE_ARGS="--nvml fake". Table on stdout, JSON in .gpustage/report.json.
GPU_STAGE_ARGS ?=
gpu-stage: setup
	$(PY) -m e2e.gpustage $(GPU_STAGE_ARGS)

# The real node's runtime (containerd, runc, crictl), built once from Go modules (same cache).
node-binaries:
	bash hack/node-binaries.sh

# The enforcer's CDI hook, the one Go program (services/enforcer/hook, standard library only):
# gofmt, go vet and its Go tests, then a static binary in ~/.cache/gpuslice/hook (no download).
hook-binary:
	bash hack/hook-binary.sh

# pause, the Python base and every services/*/Dockerfile as OCI archives, with buildah and no
# registry, into ~/.cache/gpuslice/images (manifest.json lists them; see docs/images.md).
images: setup hook-binary
	bash hack/images.sh

# A release without GitHub (docs/release.md): the images built (make images), then the release
# workflow's push steps without signing, for this machine's architecture, against a loopback
# registry: every image and the chart under VERSION, a JSON summary and the helm install command.
VERSION ?= 0.0.0-local
release-local: setup images
	bash hack/release.sh --local --version $(VERSION)

# NODES=real: plus two real nodes (containerd + kubelet each, docs/real-node.md); default: none.
NODES ?=
cluster-up: setup kube-binaries $(if $(filter real,$(NODES)),node-binaries images)
	$(PY) -m e2e.sandbox.$(if $(filter real,$(NODES)),realnode,controlplane) up

# stops real nodes too, whatever NODES says
cluster-down: setup
	$(PY) -m e2e.sandbox.realnode down

cluster-status: setup
	$(PY) -m e2e.sandbox.realnode status

clean:
	rm -rf $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache
