"""End-to-end scenarios shared by every tier that runs the gpuslice chart on real kubelets: the
sandbox's real nodes (e2e/sandbox/realnode.py) and kind (hack/e2e-kind.sh)."""
