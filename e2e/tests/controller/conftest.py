"""The controller (services/controller) as a local process against the sandbox's API server: its
admission webhooks called by the real kube-apiserver over TLS while its certificates rotate
(test_controller.py), and the chart's controller RBAC as its only permissions
(test_controller_rbac.py). Each module starts its own controller (a module fixture), so no
fixture is shared here; the readiness probe both use is e2e/support/controller.py's ``ready``.
Its cluster view is tested in view/.
"""
