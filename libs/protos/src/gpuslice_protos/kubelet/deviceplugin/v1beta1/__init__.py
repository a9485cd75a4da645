"""Generated from proto/kubelet/deviceplugin/v1beta1/ by hack/gen_protos.py; never edit by hand."""
