"""Construction of the Kubernetes API client: a kubeconfig when given, in-cluster otherwise."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException

from gpuslice_core.errors import FailedPreconditionError


def new_api_client(
    kubeconfig: str | Path | None = None, *, user_agent: str, pool_size: int | None = None
) -> client.ApiClient:
    """Return an ``ApiClient`` for ``kubeconfig``, or for the pod's service account without one.

    ``user_agent`` names the component (``gpuslice-kubelet-plugin/0.1.0``) in API server logs and
    audit events. ``pool_size`` is how many calls may run at once on kept-alive connections
    (the client's default, 5 per CPU, makes urllib3 discard connections under more threads).
    Fails with one message that says what was tried.
    """
    configuration = client.Configuration()
    if pool_size is not None:
        configuration.connection_pool_maxsize = pool_size
    if kubeconfig:
        path = Path(kubeconfig)
        if not path.is_file():
            raise FailedPreconditionError(f"--kubeconfig {path}: no such file")
        try:
            config.load_kube_config(config_file=str(path), client_configuration=configuration)
        except (ConfigException, ValueError, OSError) as exc:
            raise FailedPreconditionError(f"--kubeconfig {path} is not usable: {exc}") from exc
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            raise FailedPreconditionError(
                "no --kubeconfig (KUBECONFIG) given and not running in a pod with a service "
                f"account: {exc}"
            ) from exc
    api = client.ApiClient(configuration)
    api.user_agent = user_agent
    return api
