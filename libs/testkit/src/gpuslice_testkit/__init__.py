"""The project's own test support: never shipped, never imported by a service or a library.

A development-only workspace member (the root project's dev group depends on it; no service,
library, wheel or image does), so test helpers cannot leak into the product. One module per
component it helps test:

* :mod:`gpuslice_testkit.core`: a service as a real process (``ServiceProcess``), ``wait_for``
  with a deadline, ``at_once`` bursts, ``preserved_logging``;
* :mod:`gpuslice_testkit.enforcer`: the enforcer process, its cgroups, fake workloads, the
  CDI hook run as runc runs it;
* :mod:`gpuslice_testkit.device_plugin`: fake node layouts and settings for the device plugin;
* :mod:`gpuslice_testkit.view`: API objects as the API server returns them, for the view;
* :mod:`gpuslice_testkit.registry`: an OCI registry on a local address (Debian's
  docker-registry), and :mod:`gpuslice_testkit.release`: a release's push steps against it
  (``make release-local``, docs/release.md).
* :mod:`gpuslice_testkit.prometheus` and :mod:`gpuslice_testkit.kube_sd`: a real Prometheus
  configured from the chart's monitors as Prometheus Operator would, its Kubernetes discovery
  over HTTP, and the PromQL of the dashboard and the alert rules.

``hack/check_imports.py`` forbids importing it from ``libs/*/src`` and ``services/*/src``;
``libs/testkit/tests/test_shipped.py`` builds every shipped wheel and finds no test module in it.
"""
