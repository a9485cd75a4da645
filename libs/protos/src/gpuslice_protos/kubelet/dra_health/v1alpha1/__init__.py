"""Generated from proto/kubelet/dra_health/v1alpha1/ by hack/gen_protos.py; never edit by hand."""
