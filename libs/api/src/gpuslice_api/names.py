"""Every name gpuslice shares between components, defined once.

The DRA driver, its DeviceClasses and opaque config, the CDI vendor, and the labels and
annotations more than one component reads or writes. A component that needs one imports it from
here; a flag that lets an operator change one (the controller's ``--gpu-device-classes``)
defaults to it. Names only one module uses stay in that module.
"""

from __future__ import annotations

import hashlib

from gpuslice_core import cdi_names

#: The DRA driver: ResourceSlices' ``spec.driver``, the device attribute domain, the claim
#: config's driver, the kubelet plugin's registration name.
DRIVER = "gpu.gpuslice.dev"
#: DeviceClasses the chart installs: whole GPUs and shares of them; MIG devices.
GPU_CLASS = "gpu.gpuslice.dev"
MIG_CLASS = "mig.gpuslice.dev"
#: The opaque claim configuration's apiVersion (``GpuConfig``).
CONFIG_API_VERSION = f"{DRIVER}/v1alpha1"

#: The CDI vendor of every spec gpuslice writes (``k8s.gpu.gpuslice.dev/<class>=<device>``),
#: defined below this library, beside the CDI writer (gpuslice_core.cdi_names).
CDI_VENDOR = cdi_names.DEFAULT_VENDOR

#: Node label choosing how a node's GPUs are served: DRA (absent or ``dra``) or the device
#: plugin (``device-plugin``); the chart's node DaemonSets select on it.
MODE_LABEL = "gpuslice.dev/mode"
#: Node labels of the MIG manager: the layout asked for, and how applying it went.
MIG_CONFIG_LABEL = "gpuslice.dev/mig.config"
MIG_STATE_LABEL = "gpuslice.dev/mig.config.state"

#: Pod annotation holding the original request of a pod the controller translated to DRA (its
#: presence means the pod is translated already); the pod label that opts out (``"false"``);
#: the label on the claim templates the controller makes, naming the dialect.
TRANSLATED_ANNOTATION = f"{DRIVER}/translated-from"
TRANSLATE_LABEL = f"{DRIVER}/translate"
DIALECT_LABEL = f"{DRIVER}/dialect"

#: Label on an allocated ResourceClaim naming the node (the pool) it is allocated to, written by
#: the controller (``gpuslice_controller.claimnodes``): each kubelet plugin watches only the
#: claims labelled with its node (``node_label_value``), so a node's share of the API server's
#: watch traffic grows with its own claims, not with the cluster's.
NODE_LABEL = f"{DRIVER}/node"


def node_label_value(node: str) -> str:
    """``node`` as a label value: itself when it fits (63 characters; a node name is a DNS
    subdomain, whose characters a label value allows), else a digest of it."""
    if len(node) <= 63:
        return node
    return "h-" + hashlib.sha256(node.encode()).hexdigest()[:60]


#: The API group of the virtual resource ``gpus`` that callers of the cluster view's endpoints
#: must be allowed to ``get`` (a SubjectAccessReview; the chart's ClusterRole gpuslice-view
#: grants it). Nothing serves it: it exists only to be authorized.
VIEW_GROUP = DRIVER
