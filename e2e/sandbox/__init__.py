"""The node sandbox: a real Kubernetes control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) run as local processes on loopback.

`e2e.sandbox.controlplane` starts and stops it (also a CLI: ``python -m
e2e.sandbox.controlplane up|down|status``); the binaries come from
``hack/kube-binaries.sh``.
"""
