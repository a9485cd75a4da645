"""Generated from proto/kubelet/dra/ by hack/gen_protos.py; never edit by hand."""
