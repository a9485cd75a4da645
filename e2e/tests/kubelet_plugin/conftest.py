"""The DRA kubelet plugin (services/kubelet-plugin): in-process (``harness``, ``plugin``) and as a
process, against the sandbox's real API server on a fake node. Its fixtures are in
e2e/tests/conftest.py because controller/, view/, nodeagent/, nodepod/ and crosscutting/ run
the plugin too; the helpers (``ClaimMaker``, ``Processes``, ``RecordingRawApi``) are in
e2e/support/kubelet_plugin.py, the harness itself in gpuslice_testkit.kubelet_plugin.
"""
