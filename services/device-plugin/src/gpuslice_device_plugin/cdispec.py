"""The plugin's own CDI spec for whole GPUs and MIG devices (``cdi-annotations`` / ``cdi-cri``).

So that the CDI strategies work without the NVIDIA Container Toolkit's generated spec, the
plugin writes one spec with a CDI device per GPU and per MIG device of the node, with the
writer and layout the kubelet plugin uses (``gpuslice_core.cdi.ClaimSpecs``: atomic write,
validated, the minimum ``cdiVersion``):

- kind ``k8s.gpu.gpuslice.dev/device-plugin-gpu``, file
  ``<cdi root>/k8s.gpu.gpuslice.dev-device-plugin-gpu_node.json``, device names
  ``node-<UUID>`` (``GPU-…`` or ``MIG-…``), whatever the ``deviceIDStrategy``. The kind cannot
  collide with the toolkit's (``nvidia.com/gpu``), NVIDIA's plugin's
  (``k8s.device-plugin.nvidia.com/gpu``), the kubelet plugin's claims
  (``k8s.gpu.gpuslice.dev/claim``) or our MPS replicas (``k8s.gpu.gpuslice.dev/device-plugin``).
- Each device's edits: the GPU's ``/dev/nvidia<minor>`` (a MIG device: its parent's, and the
  capability nodes of its GPU and compute instance) and the control nodes ``/dev/nvidiactl``,
  ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` where they exist on the host (as the kubelet
  plugin does, through ``gpuslice_core.driverroot``: a node the runtime cannot find fails the
  container), the driver's compute and utility files where the plugin sees the host's driver
  root, and ``GPUSLICE_<KEY>_UUID`` / ``_DEVICE`` named after the device (docs/cdi.md:
  variables compose by name). ``NVIDIA_VISIBLE_DEVICES`` comes in the Allocate response, which
  names all of the container's devices at once.
- Written at start and at every reload (the MIG layout may have changed); other specs of this
  kind (an earlier layout or version) are removed. Writing is idempotent and a writer killed at
  any point leaves the old spec or the new one.

``--cdi-spec=toolkit`` writes nothing and hands out the toolkit's names, as before;
``both`` hands out ours and the toolkit's ``nvidia.com/gpu=<UUID>`` (driver libraries, MIG
capability nodes), like the kubelet plugin's ``--nvidia-cdi-kind``.
"""

from __future__ import annotations

from pathlib import Path

from gpuslice_api.names import CDI_VENDOR
from gpuslice_core import cdi
from gpuslice_core.driverroot import DriverRoot
from gpuslice_core.logging import get_logger
from gpuslice_nvml import Nvml

log = get_logger(__name__)

CDI_CLASS = "device-plugin-gpu"
SPEC_KEY = "node"
TOOLKIT_KIND = "nvidia.com/gpu"
SPEC_MODES: tuple[str, ...] = ("gpuslice", "toolkit", "both")


def _device(
    specs: cdi.ClaimSpecs,
    uuid: str,
    label: str,
    nodes: list[cdi.DeviceNode],
    driver_files: list[cdi.Mount],
) -> cdi.Device:
    name = specs.device_name(SPEC_KEY, uuid)
    key = "".join(c if c.isalnum() else "_" for c in name).upper()
    edits = cdi.ContainerEdits(
        env=[f"GPUSLICE_{key}_UUID={uuid}", f"GPUSLICE_{key}_DEVICE={label}"],
        device_nodes=nodes,
        mounts=driver_files,
    )
    return cdi.Device(name=name, container_edits=edits)


def write_spec(
    nvml: Nvml, cdi_root: Path, *, mode: str = "gpuslice", dev_root: Path = Path("/")
) -> dict[str, list[str]] | None:
    """Write (or, with ``mode`` toolkit, remove) the node's spec; returns UUID → the CDI ids
    Allocate names for the device, or None for the toolkit's names."""
    specs = cdi.ClaimSpecs(cdi_root, vendor=CDI_VENDOR, cdi_class=CDI_CLASS)
    if mode == "toolkit":
        for key in specs.claim_uids():
            specs.delete(key)
        return None
    driver = DriverRoot(dev_root)
    driver_files = driver.user_space()  # the same for every device: looked up once
    devices: list[cdi.Device] = []
    for gpu in nvml.gpus():
        nodes = driver.gpu_nodes(gpu.minor)
        devices.append(_device(specs, gpu.uuid, f"gpu-{gpu.index}", nodes, driver_files))
        if gpu.mig_enabled:
            for mig in sorted(nvml.mig_devices(gpu.index), key=lambda m: m.uuid):
                label = f"gpu-{gpu.index}-mig-{mig.profile}-{mig.placement.start}"
                caps = driver.mig_nodes(gpu.minor, mig.gpu_instance_id, mig.compute_instance_id)
                devices.append(_device(specs, mig.uuid, label, nodes + caps, driver_files))
    if not devices:
        return {}
    ids = specs.write(SPEC_KEY, devices)
    for key in specs.claim_uids():
        if key != SPEC_KEY:
            specs.delete(key)  # a spec of an earlier version of the plugin
    out: dict[str, list[str]] = {}
    for device, qualified in zip(devices, ids, strict=True):
        uuid = device.name.removeprefix(f"{SPEC_KEY}-")
        out[uuid] = [qualified] + ([f"{TOOLKIT_KIND}={uuid}"] if mode == "both" else [])
    log.info("CDI spec written", spec=str(specs.spec_path(SPEC_KEY)), devices=len(devices))
    return out
