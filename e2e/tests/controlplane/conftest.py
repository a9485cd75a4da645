"""The sandbox itself (e2e/sandbox): the real control plane every other folder uses
(test_controlplane.py), the parts of the sandbox that need no Kubernetes binaries
(test_sandbox_units.py), and the README's `make demo` (test_demo.py). The session's ``sandbox``
fixture is in e2e/conftest.py; nothing is shared by this folder's modules alone.
"""
