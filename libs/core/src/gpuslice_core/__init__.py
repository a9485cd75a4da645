"""gpuslice shared library."""
