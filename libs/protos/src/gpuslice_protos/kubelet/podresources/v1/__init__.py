"""Generated from proto/kubelet/podresources/v1/ by hack/gen_protos.py; never edit by hand."""
