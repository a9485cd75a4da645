"""gpuslice MIG manager: owns MIG state on a node (layouts from a label, on-demand instances)."""

__version__ = "0.1.0"
