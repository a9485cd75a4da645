"""Construction of the Kubernetes API client: a kubeconfig when given, in-cluster otherwise."""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException

from gpuslice_core.errors import FailedPreconditionError


def new_api_client(
    kubeconfig: str | Path | None = None,
    *,
    user_agent: str,
    pool_size: int | None = None,
    context: str | None = None,
) -> client.ApiClient:
    """Return an ``ApiClient`` for ``kubeconfig``, or for the pod's service account without one.

    ``kubeconfig`` may list several files as ``KUBECONFIG`` does (joined by ``os.pathsep``; they
    are merged, missing ones skipped, as kubectl does); ``context`` picks a context other than
    the current one.

    ``user_agent`` names the component (``gpuslice-kubelet-plugin/0.1.0``) in API server logs and
    audit events. ``pool_size`` is how many calls may run at once on kept-alive connections
    (the client's default, 5 per CPU, makes urllib3 discard connections under more threads).
    Fails with one message that says what was tried.
    """
    configuration = client.Configuration()
    if pool_size is not None:
        configuration.connection_pool_maxsize = pool_size
    if kubeconfig:
        paths = [Path(p) for p in str(kubeconfig).split(os.pathsep) if p]
        existing = [str(p) for p in paths if p.is_file()]
        path = os.pathsep.join(str(p) for p in paths)
        if not existing:
            raise FailedPreconditionError(f"--kubeconfig {path}: no such file")
        try:
            config.load_kube_config(
                config_file=os.pathsep.join(existing),
                context=context,
                client_configuration=configuration,
            )
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
