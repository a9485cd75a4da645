"""The real NVML backend (libnvidia-ml through nvidia-ml-py's ``pynvml``)."""

from gpuslice_nvml.real.backend import RealNvml

__all__ = ["RealNvml"]
