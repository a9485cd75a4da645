"""Generated protobuf and gRPC code. Regenerate with `make proto`; never edit by hand.

Import paths follow the directory layout under ``proto/`` (``gpuslice_protos.kubelet.dra.v1``);
the gRPC method paths follow each file's upstream ``package`` line
(``/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources``).
"""
