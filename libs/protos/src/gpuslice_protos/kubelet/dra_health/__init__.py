"""Generated from proto/kubelet/dra_health/ by hack/gen_protos.py; never edit by hand."""
