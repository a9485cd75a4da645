"""The GPU stage: gpuslice's enforcer limits checked on a real GPU, without Kubernetes."""
