"""Generated from proto/kubelet/dra/v1/ by hack/gen_protos.py; never edit by hand."""
