"""gpuslice DRA kubelet plugin (driver gpu.gpuslice.dev). See docs/kubelet-plugin.md."""

__version__ = "0.1.0"
