"""End-to-end suites for gpuslice (the node sandbox on a real Kubernetes control plane)."""
