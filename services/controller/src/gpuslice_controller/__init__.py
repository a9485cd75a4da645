"""gpuslice controller: the cluster-side service (a leader-elected Deployment).

Part 1, admission: a validating webhook that checks ResourceClaims and ResourceClaimTemplates
for gpuslice's DeviceClasses at the door (the same strict GpuConfig decoder as the kubelet
plugin, capacity requests against the device model), and a mutating webhook that turns the pod
specs of other GPU-sharing systems (HAMi, gpushare, vCUDA, qGPU, Volcano) into DRA claims.
"""

__version__ = "0.1.0"
