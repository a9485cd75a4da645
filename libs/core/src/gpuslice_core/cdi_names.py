"""The CDI vendor gpuslice writes specs under, apart from the CDI writer (``gpuslice_core.cdi``)
so that what only needs the name (``gpuslice_api.names``, and through it ``kubectl gpuslice``)
does not import the writer's pydantic models (decision 15)."""

DEFAULT_VENDOR = "k8s.gpu.gpuslice.dev"
