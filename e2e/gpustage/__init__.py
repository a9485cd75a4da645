"""The GPU stage: gpuslice's limits and device specs proven on one real GPU, no Kubernetes."""
