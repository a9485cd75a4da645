"""Generated from proto/kubelet/pluginregistration/v1/ by hack/gen_protos.py; never edit by hand."""
