"""Generated from proto/kubelet/podresources/ by hack/gen_protos.py; never edit by hand."""
