"""Per-claim CDI spec files: typed CDI 1.x models, validation, atomic write, strict read, resolve.

The kubelet plugin writes one transient spec per prepared claim into the CDI root (default
``/var/run/cdi``) and hands the kubelet fully-qualified CDI device ids; the container runtime
(or the sandbox's simulated kubelet, through :func:`resolve`) turns those ids into container edits.

Naming (docs/cdi.md, "Naming"):

- kind ``<vendor>/<class>``, by default ``k8s.gpu.gpuslice.dev/claim``;
- device name ``<claimUID>-<device>[-<shareID>]``, qualified id ``<kind>=<device name>``;
- file ``<cdi root>/<vendor>-<class>_<claimUID>.json`` (CDI's transient spec name), so every
  claim has its own file and the claim UIDs with a file can be listed for garbage collection.

Validation follows the CDI reference loader (names, env ``KEY=VALUE``, hook names, device-node
types and permissions) and is stricter in one respect: paths must be absolute. See docs/cdi.md.

The ``cdiVersion`` written is the lowest one that covers the features used (a runtime with an
older CDI library can then still read the file), by this table from the reference's
``specs-go/version.go``:

=======  ============================================================================
0.3.0    baseline (earliest version the reference loader accepts)
0.4.0    ``type`` on a mount
0.5.0    ``hostPath`` on a device node; a device name that does not start with a letter
         (claim UIDs start with digits, so gpuslice specs are at least 0.5.0)
0.6.0    ``annotations`` on the spec or a device; a ``.`` in the class part of ``kind``
0.7.0    ``intelRdt``; ``additionalGids``
0.8.0    no spec change (API-only release)
1.0.0    no spec change (API-only release)
1.1.0    ``netDevices``; ``intelRdt.schemata`` or ``intelRdt.enableMonitoring``
=======  ============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from gpuslice_core.cdi_names import DEFAULT_VENDOR as DEFAULT_VENDOR
from gpuslice_core.errors import (
    CorruptStateError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from gpuslice_core.files import (
    atomic_write_bytes,
    temp_files_for,
)
from gpuslice_core.strict import describe_errors

DEFAULT_CDI_ROOT = Path("/var/run/cdi")
DEFAULT_CLASS = "claim"
KNOWN_VERSIONS = (*(f"0.{minor}.0" for minor in range(1, 9)), "1.0.0", "1.1.0")
EARLIEST_VERSION = "0.3.0"
HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
DEVICE_NODE_TYPES = frozenset({"", "b", "c", "u", "p"})

_VENDOR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_CLAIM_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_RULES = {
    _VENDOR_CLASS: "start with a letter, end with a letter or digit, hold only A-Z a-z 0-9 - _ .",
    _DEVICE_NAME: "start and end with a letter or digit, hold only A-Z a-z 0-9 - _ . :",
    _CLAIM_UID: "start and end with a letter or digit, hold only A-Z a-z 0-9 - _ .",
}
_ANNOTATION_KEY_RE = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)


class _CdiModel(BaseModel):
    """Snake-case fields in Python, the exact CDI camelCase names in JSON; no unknown keys."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, extra="forbid")


class DeviceNode(_CdiModel):
    path: str
    host_path: str = ""
    type: str = ""
    major: int = 0
    minor: int = 0
    file_mode: int | None = None
    permissions: str = ""
    uid: int | None = None
    gid: int | None = None


class Mount(_CdiModel):
    host_path: str
    container_path: str
    options: list[str] = []
    type: str = ""


class Hook(_CdiModel):
    hook_name: str
    path: str
    args: list[str] = []
    env: list[str] = []
    timeout: int | None = None


class IntelRdt(_CdiModel):
    clos_id: str = Field(default="", validation_alias="closID", serialization_alias="closID")
    l3_cache_schema: str = ""
    mem_bw_schema: str = ""
    schemata: list[str] = []
    enable_monitoring: bool = False


class NetDevice(_CdiModel):
    host_interface_name: str
    name: str


class ContainerEdits(_CdiModel):
    env: list[str] = []
    device_nodes: list[DeviceNode] = []
    mounts: list[Mount] = []
    hooks: list[Hook] = []
    intel_rdt: IntelRdt | None = None
    additional_gids: list[int] = []
    net_devices: list[NetDevice] = []

    def is_empty(self) -> bool:
        return self == ContainerEdits()


class Device(_CdiModel):
    name: str
    annotations: dict[str, str] = {}
    container_edits: ContainerEdits


class Spec(_CdiModel):
    cdi_version: str
    kind: str
    annotations: dict[str, str] = {}
    devices: list[Device]
    container_edits: ContainerEdits = Field(default_factory=ContainerEdits)

    def to_json(self) -> str:
        """The spec as CDI JSON: exact field names, empty fields left out."""
        return self.model_dump_json(by_alias=True, exclude_defaults=True, indent=2) + "\n"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.removeprefix("v").split("."))


def minimum_version(spec: Spec) -> str:
    """The lowest CDI version that covers every feature ``spec`` uses (table in the docstring)."""
    edits = [spec.container_edits, *(d.container_edits for d in spec.devices)]
    rdts = [e.intel_rdt for e in edits if e.intel_rdt is not None]
    if any(e.net_devices for e in edits) or any(r.schemata or r.enable_monitoring for r in rdts):
        return "1.1.0"
    if rdts or any(e.additional_gids for e in edits):
        return "0.7.0"
    vendor, _, cdi_class = spec.kind.partition("/")
    annotated = spec.annotations or any(d.annotations for d in spec.devices)
    if annotated or (vendor and "." in cdi_class):
        return "0.6.0"
    digit_start = any(not (d.name[:1].isascii() and d.name[:1].isalpha()) for d in spec.devices)
    if digit_start or any(n.host_path for e in edits for n in e.device_nodes):
        return "0.5.0"
    if any(m.type for e in edits for m in e.mounts):
        return "0.4.0"
    return EARLIEST_VERSION


def _check_name(what: str, name: str, pattern: re.Pattern[str]) -> None:
    if not pattern.fullmatch(name):
        raise InvalidArgumentError(f"{what} {name!r} is invalid: it must {_RULES[pattern]}")


def validate_kind(kind: str) -> tuple[str, str]:
    """Check ``<vendor>/<class>`` and return its two parts."""
    vendor, slash, cdi_class = kind.partition("/")
    if not slash:
        raise InvalidArgumentError(f"CDI kind {kind!r} is not <vendor>/<class>")
    _check_name("CDI vendor", vendor, _VENDOR_CLASS)
    _check_name("CDI class", cdi_class, _VENDOR_CLASS)
    return vendor, cdi_class


def validate_device_name(name: str) -> None:
    _check_name("CDI device name", name, _DEVICE_NAME)


def _edits_problems(where: str, edits: ContainerEdits) -> Iterable[str]:
    def bad_env(entries: list[str]) -> list[str]:
        return [e for e in entries if e.find("=") <= 0]

    if bad := bad_env(edits.env):
        yield f"{where}: env entries must be KEY=VALUE: {bad}"
    for i, node in enumerate(edits.device_nodes):
        at = f"{where}: deviceNodes[{i}] ({node.path!r})"
        if not node.path.startswith("/"):
            yield f"{at}: path must be absolute"
        if node.host_path and not node.host_path.startswith("/"):
            yield f"{at}: hostPath {node.host_path!r} must be absolute"
        if node.type not in DEVICE_NODE_TYPES:
            yield f"{at}: type {node.type!r} is not one of b, c, u, p"
        if node.permissions != "none" and set(node.permissions) - set("rwm"):
            yield f"{at}: permissions {node.permissions!r} must be drawn from 'rwm'"
        numbers = [node.major, node.minor, node.file_mode, node.uid, node.gid]
        if any(n is not None and n < 0 for n in numbers):
            yield f"{at}: major, minor, fileMode, uid and gid must not be negative"
    for i, mount in enumerate(edits.mounts):
        at = f"{where}: mounts[{i}]"
        if not mount.container_path.startswith("/"):
            yield f"{at}: containerPath {mount.container_path!r} must be absolute"
        if not mount.host_path:
            yield f"{at}: hostPath must not be empty"
        elif mount.type in ("", "bind") and not mount.host_path.startswith("/"):
            yield f"{at}: hostPath {mount.host_path!r} of a bind mount must be absolute"
    for i, hook in enumerate(edits.hooks):
        at = f"{where}: hooks[{i}]"
        if hook.hook_name not in HOOK_NAMES:
            yield f"{at}: hookName {hook.hook_name!r} is not one of {sorted(HOOK_NAMES)}"
        if not hook.path.startswith("/"):
            yield f"{at}: path {hook.path!r} must be absolute"
        if bad := bad_env(hook.env):
            yield f"{at}: env entries must be KEY=VALUE: {bad}"
        if hook.timeout is not None and hook.timeout <= 0:
            yield f"{at}: timeout must be positive"
    if any(not 0 <= gid < 2**32 for gid in edits.additional_gids):
        yield f"{where}: additionalGids must be 32-bit unsigned integers"
    if any(not n.host_interface_name or not n.name for n in edits.net_devices):
        yield f"{where}: netDevices need hostInterfaceName and name"


def _annotation_problems(where: str, annotations: dict[str, str]) -> Iterable[str]:
    for key in annotations:
        if not _ANNOTATION_KEY_RE.fullmatch(key) or len(key.partition("/")[0]) > 253:
            yield f"{where}: annotation key {key!r} is not a valid qualified name"


def validate_spec(spec: Spec) -> None:
    """Check ``spec`` like the CDI reference loader; one error lists every problem."""
    problems: list[str] = []

    def check(fn: Callable[[str], object], arg: str) -> None:
        try:
            fn(arg)
        except InvalidArgumentError as exc:
            problems.append(str(exc))

    if spec.cdi_version.removeprefix("v") not in KNOWN_VERSIONS:
        problems.append(f"cdiVersion {spec.cdi_version!r} is not one of {KNOWN_VERSIONS}")
    elif _version_key(spec.cdi_version) < _version_key(needed := minimum_version(spec)):
        problems.append(
            f"cdiVersion {spec.cdi_version} is too low: the features used need {needed}"
        )
    check(validate_kind, spec.kind)
    problems += _annotation_problems("spec", spec.annotations)
    problems += _edits_problems("spec containerEdits", spec.container_edits)
    if not spec.devices:
        problems.append("a spec must define at least one device")
    names = [d.name for d in spec.devices]
    for device in spec.devices:
        where = f"device {device.name!r}"
        check(validate_device_name, device.name)
        if names.count(device.name) > 1:
            problems.append(f"{where} is defined more than once")
        if device.container_edits.is_empty():
            problems.append(f"{where}: containerEdits must not be empty")
        problems += _annotation_problems(where, device.annotations)
        problems += _edits_problems(where, device.container_edits)
    if problems:
        raise InvalidArgumentError(f"invalid CDI spec (kind {spec.kind!r}): " + "; ".join(problems))


def parse_qualified_name(qualified: str) -> tuple[str, str, str]:
    """Split ``<vendor>/<class>=<name>`` into its parts, validating each."""
    kind, eq, name = qualified.partition("=")
    if not eq:
        raise InvalidArgumentError(f"CDI device id {qualified!r} is not <vendor>/<class>=<name>")
    vendor, cdi_class = validate_kind(kind)
    validate_device_name(name)
    return vendor, cdi_class, name


class ClaimSpecs:
    """Writes, deletes and lists the per-claim spec files of one vendor/class in a CDI root."""

    def __init__(
        self,
        cdi_root: Path | str = DEFAULT_CDI_ROOT,
        *,
        vendor: str = DEFAULT_VENDOR,
        cdi_class: str = DEFAULT_CLASS,
    ) -> None:
        self.kind = f"{vendor}/{cdi_class}"
        validate_kind(self.kind)
        self.root = Path(cdi_root)
        self._prefix = f"{vendor}-{cdi_class}_"  # CDI's transient spec name: <vendor>-<class>_<id>

    def device_name(self, claim_uid: str, device: str, share_id: str | None = None) -> str:
        """``<claimUID>-<device>[-<shareID>]``, validated."""
        _check_name("claim UID", claim_uid, _CLAIM_UID)
        name = f"{claim_uid}-{device}" + (f"-{share_id}" if share_id else "")
        validate_device_name(name)
        return name

    def qualified_id(self, device_name: str) -> str:
        """``<vendor>/<class>=<device name>``: what the kubelet hands to the runtime."""
        validate_device_name(device_name)
        return f"{self.kind}={device_name}"

    def spec_path(self, claim_uid: str) -> Path:
        _check_name("claim UID", claim_uid, _CLAIM_UID)
        return self.root / f"{self._prefix}{claim_uid}.json"

    def write(
        self,
        claim_uid: str,
        devices: Sequence[Device],
        *,
        container_edits: ContainerEdits | None = None,
        annotations: dict[str, str] | None = None,
    ) -> list[str]:
        """Validate and atomically (re)write the claim's spec at the minimum cdiVersion its
        features need; return the qualified device ids in order.

        ``container_edits`` (the spec's own) reach every container that gets *any* device of the
        spec, whichever request it names: describe a device in its own edits (docs/cdi.md)."""
        path = self.spec_path(claim_uid)
        foreign = [d.name for d in devices if not d.name.startswith(f"{claim_uid}-")]
        if foreign:
            raise InvalidArgumentError(
                f"CDI devices of claim {claim_uid} must be named <claimUID>-<device>: {foreign}"
            )
        spec = Spec(
            cdi_version=EARLIEST_VERSION,
            kind=self.kind,
            annotations=annotations or {},
            devices=list(devices),
            container_edits=container_edits or ContainerEdits(),
        )
        spec.cdi_version = minimum_version(spec)
        validate_spec(spec)
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in temp_files_for(path):  # from a writer killed mid-write
            leftover.unlink(missing_ok=True)
        # atomic, not fsynced: a claim's spec lives as long as the boot (docs/cdi.md)
        atomic_write_bytes(path, spec.to_json().encode("utf-8"), mode=0o644, durable=False)
        return [self.qualified_id(d.name) for d in spec.devices]

    def delete(self, claim_uid: str) -> bool:
        """Remove the claim's spec; True if there was one. A missing file is fine."""
        try:
            self.spec_path(claim_uid).unlink()
        except FileNotFoundError:
            return False
        return True

    def claim_uids(self) -> list[str]:
        """Claim UIDs that have a spec file here (to garbage-collect orphans)."""
        files = self.root.glob(f"{self._prefix}*.json") if self.root.is_dir() else []
        uids = [p.name[len(self._prefix) : -len(".json")] for p in files]
        return sorted(u for u in uids if _CLAIM_UID.fullmatch(u))


def load_spec(path: Path | str) -> Spec:
    """Read a JSON CDI spec strictly (unknown fields, wrong types, CDI rule violations fail)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise NotFoundError(f"CDI spec {path} does not exist") from exc
    try:
        spec = Spec.model_validate_json(raw, strict=True, by_alias=True, by_name=False)
        validate_spec(spec)
    except ValidationError as exc:
        raise CorruptStateError(f"CDI spec {path}: {describe_errors(exc, Spec)}") from exc
    except InvalidArgumentError as exc:
        raise CorruptStateError(f"CDI spec {path}: {exc}") from exc
    return spec


_V = TypeVar("_V")


def _put(table: dict[str, _V], key: str, value: _V, what: str, strict: bool) -> None:
    if strict and key in table and table[key] != value:
        raise FailedPreconditionError(
            f"conflicting CDI edits: {what} {key!r} is set to {table[key]!r} and to {value!r}"
        )
    table[key] = value


def merge_edits(parts: Iterable[ContainerEdits], *, strict: bool = False) -> ContainerEdits:
    """Combine edits in order, as a runtime applies them to one container.

    Env entries, device nodes (by container path) and mounts (by container path) are keyed:
    a later one replaces an earlier one, as the runtime's OCI spec editor does; with ``strict``
    two different values for one key raise instead. Hooks, net devices and GIDs accumulate.
    """
    env: dict[str, str] = {}
    nodes: dict[str, DeviceNode] = {}
    mounts: dict[str, Mount] = {}
    hooks: list[Hook] = []
    net_devices: list[NetDevice] = []
    gids: list[int] = []
    intel_rdt: IntelRdt | None = None
    for part in parts:
        for entry in part.env:
            key, _, value = entry.partition("=")
            _put(env, key, value, "env", strict)
        for node in part.device_nodes:
            _put(nodes, node.path, node, "device node", strict)
        for mount in part.mounts:
            _put(mounts, mount.container_path, mount, "mount at", strict)
        hooks += part.hooks
        net_devices += part.net_devices
        gids += [g for g in part.additional_gids if g not in gids]
        intel_rdt = part.intel_rdt or intel_rdt
    return ContainerEdits(
        env=[f"{k}={v}" for k, v in env.items()],
        device_nodes=list(nodes.values()),
        mounts=list(mounts.values()),
        hooks=hooks,
        intel_rdt=intel_rdt,
        additional_gids=gids,
        net_devices=net_devices,
    )


def resolve(
    cdi_roots: Path | str | Sequence[Path | str],
    qualified_ids: Iterable[str],
    *,
    strict: bool = False,
) -> ContainerEdits:
    """Turn qualified CDI device ids into the merged edits a runtime would apply.

    Every ``*.json`` spec in the roots is read; a later root wins over an earlier one (as
    ``/var/run/cdi`` wins over ``/etc/cdi``); a device defined twice within one root is a
    conflict. Each spec's own edits are applied once, before the edits of its first requested
    device. An unknown id raises NotFoundError, a conflicting one FailedPreconditionError.
    """
    roots = [Path(cdi_roots)] if isinstance(cdi_roots, str | Path) else [Path(r) for r in cdi_roots]
    wanted = list(dict.fromkeys(qualified_ids))
    for qualified in wanted:
        parse_qualified_name(qualified)
    found: dict[str, list[tuple[Spec, Device, Path]]] = {}
    unreadable: list[str] = []
    for root in roots:
        in_root: dict[str, list[tuple[Spec, Device, Path]]] = {}
        for path in sorted(root.glob("*.json")) if root.is_dir() else []:
            try:
                spec = load_spec(path)
            except (CorruptStateError, NotFoundError) as exc:
                unreadable.append(str(exc))  # a runtime skips broken specs, too
                continue
            for device in spec.devices:
                in_root.setdefault(f"{spec.kind}={device.name}", []).append((spec, device, path))
        found.update(in_root)  # a later root wins
    missing = [q for q in wanted if q not in found]
    if missing:
        hint = f"; unreadable specs: {unreadable}" if unreadable else ""
        raise NotFoundError(
            f"unresolvable CDI devices {missing} in {[str(r) for r in roots]}{hint}"
        )
    parts: list[ContainerEdits] = []
    applied: set[Path] = set()
    for qualified in wanted:
        if len(found[qualified]) > 1:
            paths = [str(p) for _, _, p in found[qualified]]
            raise FailedPreconditionError(
                f"CDI device {qualified} is defined in several specs {paths}"
            )
        spec, device, path = found[qualified][0]
        if path not in applied:
            applied.add(path)
            parts.append(spec.container_edits)
        parts.append(device.container_edits)
    return merge_edits(parts, strict=strict)
