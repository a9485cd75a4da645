"""Generated from proto/gpuslice/ by hack/gen_protos.py; never edit by hand."""
