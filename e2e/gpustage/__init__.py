"""The GPU stage: the enforcer's mechanisms measured on one real GPU, without Kubernetes.

``python -m e2e.gpustage`` (``make gpu-stage``); see docs/gpu-stage.md. On the fake NVML backend
the same stage runs in CI (e2e/gpustage/tests).
"""
