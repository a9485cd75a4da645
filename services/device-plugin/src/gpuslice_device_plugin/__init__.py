"""gpuslice device plugin: ``nvidia.com/gpu`` through the kubelet device plugin API v1beta1."""

__version__ = "0.1.0"
