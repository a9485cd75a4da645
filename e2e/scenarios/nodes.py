"""The fake GPUs every scenario cluster has, and the chart values that give them to it.

Each GPU node gets the same fake NVML node (the chart's node-setup adds the node's name, so the
UUIDs differ per node):

    gpu-0  NVIDIA L4            shares: 30 + 50 cores fit, a third 40-core share does not
    gpu-1  NVIDIA L4            whole-GPU claims, the legacy nvidia.com/gpu pod, drains
    gpu-2  NVIDIA L4            a claim shared by two pods, restarts
    gpu-3  A100-SXM4-40GB       in MIG mode: 3g.20gb at 4, 2g.10gb at 0, 1g.5gb at 2 and 3

Nodes labelled gpuslice.dev/mode=device-plugin get the same fake node through the device
plugin instead: four nvidia.com/gpu (MIG strategy none counts the MIG GPU as one).

The same values drive the real-node tier and kind (docs/real-node.md).
"""

from __future__ import annotations

from typing import Any

SHARE_GPU = 0
WHOLE_GPU = 1
SHARED_CLAIM_GPU = 2
MIG_GPU = 3
L4_MEMORY = 24 * 1024**3  # rounded down: an L4 has 23034 MiB

# An A100 in MIG mode cut as in NVIDIA's MIG quickstart (also the node-agent tier's isolation
# tests, e2e/tests/nodepod/test_node_pod_isolation.py)
QUICKSTART_MIG_A100: dict[str, Any] = {
    "model": "A100-SXM4-40GB",
    "migEnabled": True,
    "migInstances": [
        {"profile": "2g.10gb", "placement": 0},
        {"profile": "1g.5gb", "placement": 2},
        {"profile": "1g.5gb", "placement": 3},
        {"profile": "3g.20gb", "placement": 4},
    ],
}
FAKE_NODE: dict[str, Any] = {
    "driverVersion": "570.158.01",
    "cudaDriverVersion": "12.8",
    "gpus": [
        {"model": "L4", "count": 3, "numaNode": 0},
        {**QUICKSTART_MIG_A100, "numaNode": 0},
    ],
}


def gpu_count() -> int:
    """The GPUs of FAKE_NODE (a GPU entry without ``count`` is one)."""
    return sum(int(g.get("count", 1)) for g in FAKE_NODE["gpus"])


def chart_values(images: dict[str, str] | None = None, *, registry: str = "") -> dict[str, Any]:
    """Helm values for a scenario cluster: the fake NVML node above, and where the images come
    from; everything else is the chart's default.

    - ``registry`` alone (the real-node tier): the chart's own image references under that
      registry prefix (``image.registry``, tags = the chart's appVersion) and its default pull
      policy, every component on: the nodes pull as a user's nodes do;
    - ``images`` (kind: service name → the full reference `kind load` put on the nodes): those
      references with the chart's default pull policy (IfNotPresent finds them on the node);
      the controller and the device plugin only where their image is given.
    """
    if images is None:
        return {
            "image": {"registry": registry},
            "nvml": {"backend": "fake", "fakeConfig": FAKE_NODE},
        }

    def image(service: str) -> dict[str, str]:
        ref = images[service]
        repository, _, tag = ref.rpartition(":")
        return {"repository": repository, "tag": tag}

    return {
        "image": {"registry": registry},
        "nvml": {"backend": "fake", "fakeConfig": FAKE_NODE},
        "kubeletPlugin": {"image": image("kubelet-plugin")},
        "enforcer": {"image": image("enforcer")},
        "migManager": {"image": image("mig-manager")},
        **(
            {"devicePlugin": {"image": image("device-plugin")}} if "device-plugin" in images else {}
        ),
        # the controller's webhooks (pod dialects, claim validation) where its image is given
        "controller": (
            {"enabled": True, "image": image("controller")}
            if "controller" in images
            else {"enabled": False}
        ),
    }
