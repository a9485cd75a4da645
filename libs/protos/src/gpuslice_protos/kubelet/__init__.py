"""Generated from proto/kubelet/ by hack/gen_protos.py; never edit by hand."""
