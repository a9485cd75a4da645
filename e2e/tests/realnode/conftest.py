"""The real-node tier: real kubelets and containerd in the sandbox's node containers
(e2e/sandbox/realnode.py) running the chart installed from our images (test_realnode.py, and
the user scenarios of e2e/scenarios in test_realnode_scenarios.py, which the kind tier
e2e/kind reuses). `make e2e-real` runs this folder; it needs the images of hack/images.sh and
skips, saying why, where real nodes cannot run. The real-node fixtures are
e2e/sandbox/realnode_fixtures.py (named with ``pytest_plugins`` by the modules that use them);
nothing is shared by this folder's modules alone.
"""
