#!/usr/bin/env bash
# The e2e scenarios (e2e/scenarios/user.py) in kind, for users' CI where Docker exists: the same
# scenarios, chart values and fake GPUs as the sandbox's real-node tier (`make e2e-real`).
#   1. a kind cluster from hack/kind/cluster.yaml (DRA gates, two fake-GPU workers)
#   2. every service image built with docker from its own Dockerfile, `kind load`ed
#   3. pytest e2e/kind: helm install of charts/gpuslice, helm test, the scenarios
#
# usage: hack/e2e-kind.sh [--keep]      (--keep: leave the cluster up afterwards)
# env:   KIND_CLUSTER (gpuslice-e2e), KIND_NODE_IMAGE (kind's default for its version; needs
#        Kubernetes 1.34+), IMAGE_TAG (e2e)
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CLUSTER=${KIND_CLUSTER:-gpuslice-e2e}
TAG=${IMAGE_TAG:-e2e}
KEEP=0
[ "${1:-}" != --keep ] || KEEP=1

die() { printf 'e2e-kind: %s\n' "$*" >&2; exit 2; }
command -v docker >/dev/null 2>&1 || die "needs Docker (docker CLI and a running engine); \
this machine has none. The same scenarios run without Docker on the sandbox's real kubelets: make e2e-real"
docker info >/dev/null 2>&1 || die "the docker CLI is here but no engine answers (docker info failed); \
start Docker, or run the same scenarios on the sandbox's real kubelets: make e2e-real"
command -v kind >/dev/null 2>&1 || die "needs kind (https://kind.sigs.k8s.io), e.g. go install sigs.k8s.io/kind@latest"
HELM=$(bash "$REPO_ROOT/hack/install-helm.sh")

cd "$REPO_ROOT"
clusters=$(kind get clusters 2>/dev/null || true)  # captured, then matched (pipefail)
if ! grep -qx "$CLUSTER" <<<"$clusters"; then
  kind create cluster --name "$CLUSTER" --config hack/kind/cluster.yaml ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
fi
[ "$KEEP" = 1 ] || trap 'kind delete cluster --name "$CLUSTER"' EXIT

images="{"
for dockerfile in services/*/Dockerfile; do
  service=$(basename "$(dirname "$dockerfile")")
  ref="gpuslice/$service:$TAG"
  docker build -f "$dockerfile" -t "$ref" .
  kind load docker-image --name "$CLUSTER" "$ref"
  images+="\"$service\": \"$ref\","
done
images="${images%,}}"

KUBECONFIG_FILE=$(mktemp)
kind get kubeconfig --name "$CLUSTER" > "$KUBECONFIG_FILE"
GPUSLICE_KIND_CLUSTER=$CLUSTER GPUSLICE_KIND_KUBECONFIG=$KUBECONFIG_FILE \
  GPUSLICE_KIND_IMAGES=$images GPUSLICE_HELM=$HELM \
  .venv/bin/pytest -q -p no:cacheprovider e2e/kind
