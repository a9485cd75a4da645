"""Generated from proto/kubelet/deviceplugin/ by hack/gen_protos.py; never edit by hand."""
