"""The enforcer (services/enforcer): the real ``gpuslice-enforcer`` process on the fake NVML, over
its unix socket: its API, CDI hook and restart, MPS tiers, the watchdog on real processes in
real cgroups, the MPS backstop, hostile clients and the static hook without libc.

``hook_kind`` (e2e/conftest.py) runs a test with each CDI hook in turn, the static Go binary and
the Python hook; the helpers are gpuslice_testkit.enforcer. No fixture is shared by this
folder's modules alone.
"""
