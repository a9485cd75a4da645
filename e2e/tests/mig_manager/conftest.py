"""The MIG manager (services/mig-manager) as a process against the sandbox's API server on the fake
NVML. One module, so nothing is shared here.
"""
