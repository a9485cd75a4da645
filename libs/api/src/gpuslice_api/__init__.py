"""gpuslice's user-facing API types, shared by every component that reads them.

``gpuconfig``: the opaque claim configuration ``gpu.gpuslice.dev/v1alpha1`` ``GpuConfig`` and
NVIDIA's ``resource.nvidia.com/v1beta1`` kinds mapped onto it (``nvconfig``), decoded strictly;
``quantity``: Kubernetes resource quantities as exact numbers; ``enforcer``: the enforcer gRPC
API's levels, mechanisms and container edits as its clients (both plugins) read them.

The kubelet plugin decodes a claim's config at prepare and the controller's admission webhook
decodes it at the door, with the same code, so a claim the webhook admits is one the node
accepts.
"""
