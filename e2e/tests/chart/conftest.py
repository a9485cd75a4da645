"""The Helm chart charts/gpuslice: rendered offline (`helm template`, `helm lint`, the schema, every
container's environment against the service's own CLI, node-setup.py run for real) and against
the sandbox's real API server (server-side dry runs, a real `helm install` whose RBAC and
admission policies are exercised). `make chart` runs test_chart.py; test_chart_guards.py
holds the chart's guards against misconfiguration.

``helm_bin`` is a fixture in e2e/tests/conftest.py (controller/, device_plugin/ and view/ render
the chart too); the rendering helpers (``render``, ``containers``, ``sets``, ...) are in
e2e/support/chart.py. No fixture is shared by this folder's modules alone.
"""
