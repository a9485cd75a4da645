"""The node DaemonSet pod on the sandbox's control plane: the real kubelet plugin, enforcer and
MIG manager processes of one sandbox GPU node (e2e/sandbox/nodeservices.py) talking over their
unix sockets as the node pod's containers do, with pods the real scheduler allocates and the
node agent (the simulated kubelet) starts. No real kubelet: that is realnode/.

They use the kubelet-plugin fixtures of e2e/tests/conftest.py; nothing is shared by this
folder's modules alone.
"""
