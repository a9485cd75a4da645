"""``gpuslice-node-setup``: prepares a node for the gpuslice node pods (Helm chart).

The chart runs it as the init container of the node DaemonSet and of the device-plugin DaemonSet,
before the services start, with the image of one of the services (every service image installs
gpuslice-core, so every one has the console script). It does what its flags or environment ask
for, each step idempotent, in this order:

1. ``--socket-dir`` (GPUSLICE_SOCKET_DIR), :mod:`.sockets`: removes the per-pod sockets
   (``enforcer-<podUID>.sock``, ``mig-manager-<podUID>.sock``) that no process listens on any
   more -- left behind by pods killed without a graceful stop. A socket with a listener is never
   touched.
2. ``--fake-nvml-config-src`` -> ``--fake-nvml-config``, :mod:`.fakenvml`: writes the fake NVML
   node config for this node (the ConfigMap's YAML, plus ``name: <GPUSLICE_NODE_NAME>`` when
   GPUSLICE_FAKE_NVML_SET_NAME is true, so every fake node gets its own GPU UUIDs), atomically.
3. ``--hook-install-dir`` (the host directory as mounted here) and ``--hook-host-dir`` (the same
   directory as the host sees it), :mod:`.hook`: installs ``bin/gpuslice-enforcer-hook`` for the
   CDI createContainer hook (docs/enforcer.md), the enforcer image's static binary, replaced
   atomically and then run once from where it lies; removes the Python hook releases of earlier
   charts.

``gpuslice-node-setup hook-socket claim`` (the enforcer container's postStart) points the stable
link GPUSLICE_HOOK_SOCKET (``enforcer.sock``, the path the CDI hook calls) at this pod's enforcer
socket GPUSLICE_SOCKET; ``... release`` (its preStop) hands the link to another enforcer socket
with a listener, if it still points at this pod's (:mod:`.sockets`).

Exit status 0 when every asked-for step succeeded; 1 with the reason on stderr otherwise; 2 for a
usage error. Standard library only (it imports nothing of gpuslice_core's dependencies), so it
runs in any image that holds the package.
"""
