"""Generated from proto/gpuslice/v1/ by hack/gen_protos.py; never edit by hand."""
