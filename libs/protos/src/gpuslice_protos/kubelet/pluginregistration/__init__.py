"""Generated from proto/kubelet/pluginregistration/ by hack/gen_protos.py; never edit by hand."""
