"""The node agent (e2e/sandbox/nodeagent, the simulated kubelet) against the sandbox's control
plane: pods, device plugins, DRA plugins, pod resources, health. The DRA tests run a stand-in DRA
plugin (e2e/support/standin_dra_plugin.py) with hand-written slices and claims
(e2e/support/dra_objects.py); ``standin`` and ``device_class`` set them up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import unique, wait_for
from e2e.support.dra_objects import RESOURCE
from e2e.support.standin_dra_plugin import DRIVER, StandinDraPlugin
from gpuslice_kube.errors import KubeNotFoundError
from gpuslice_kube.raw import RawApi, resource_path


@pytest.fixture
def device_class(kube: RawApi) -> Iterator[str]:
    name = unique("standin-gpu")
    kube.create(
        resource_path(RESOURCE, "deviceclasses"),
        {
            "apiVersion": RESOURCE,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {
                "selectors": [
                    {
                        "cel": {
                            "expression": f'device.driver == "{DRIVER}" && '
                            f'device.attributes["{DRIVER}"].type == "gpu"'
                        }
                    }
                ]
            },
        },
    )
    yield name
    with contextlib.suppress(KubeNotFoundError):
        kube.delete(resource_path(RESOURCE, "deviceclasses", name=name))


@pytest.fixture
def standin(node_agent: NodeAgent, kube: RawApi) -> Iterator[StandinDraPlugin]:
    plugin = StandinDraPlugin.for_agent(node_agent, kube).start()
    wait_for(plugin.registered.is_set, 10, "the stand-in plugin to be registered")
    yield plugin
    plugin.stop()
