"""The plugin's configuration: NVIDIA's ``version: v1`` file format, decoded strictly.

The file is the one NVIDIA's k8s-device-plugin reads (``flags``, ``sharing.timeSlicing``,
``sharing.mps``), so a ConfigMap written for it keeps working. Every key this plugin does not
implement is refused at start-up by name — never silently ignored — with a sentence that says
so when NVIDIA's plugin knows the key (``flags.mpsRoot``, ``flags.nvidiaDriverRoot``, ...),
and the list of allowed keys when nobody knows it. Precedence, as in NVIDIA's plugin:
command-line flag > environment variable > config file > built-in default (:func:`resolve`).

Per-node selection (:func:`select_config`): a directory of named configs (the keys of a
ConfigMap mounted as a volume), one picked by the node's ``nvidia.com/device-plugin.config``
label, else the default, else the only one — the rules of NVIDIA's config-manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuslice_core import strict
from gpuslice_core.errors import InvalidArgumentError

MigStrategy = Literal["none", "single", "mixed"]
ListStrategy = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]
IdStrategy = Literal["uuid", "index"]
MIG_STRATEGIES: tuple[str, ...] = ("none", "single", "mixed")
LIST_STRATEGIES: tuple[str, ...] = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
ID_STRATEGIES: tuple[str, ...] = ("uuid", "index")
RESOURCE_PREFIX = "nvidia.com/"
#: Client CUDA contexts one MPS server takes per GPU (Volta and later).
MPS_MAX_CLIENTS = 48

#: Keys of NVIDIA's format that this plugin does not implement yet, with what to do instead.
UNSUPPORTED: dict[tuple[str, ...], str] = {
    ("resources",): "resource renaming is not supported (NVIDIA's plugin disables it too)",
    ("imex",): "IMEX channels are not supported",
    ("flags", "nvidiaDriverRoot"): "use --driver-root (GPUSLICE_DRIVER_ROOT) instead",
    ("flags", "nvidiaDevRoot"): "the device root is not configurable yet",
    ("flags", "mpsRoot"): (
        "the enforcer sidecar owns the MPS root (its --mps-root); sharing.mps needs no root here"
    ),
    ("flags", "gdrcopyEnabled"): "GDRCopy is not supported",
    ("flags", "gdsEnabled"): "GPUDirect Storage is not supported",
    ("flags", "mofedEnabled"): "MOFED is not supported",
    ("flags", "useNodeFeatureAPI"): "GPU feature discovery is not part of this plugin",
    ("flags", "deviceDiscoveryStrategy"): "devices are always discovered through NVML",
    ("flags", "gfd"): "GPU feature discovery is not part of this plugin",
    ("flags", "plugin", "cdiAnnotationPrefix"): "the CDI annotation prefix is fixed (cdi.k8s.io/)",
    ("flags", "plugin", "nvidiaCTKPath"): (
        "the plugin writes its own CDI spec without nvidia-ctk (--cdi-spec)"
    ),
    ("flags", "plugin", "containerDriverRoot"): "the container driver root is not configurable",
    ("flags", "plugin", "sharedDevicesAllocationPolicy"): (
        "use --shared-allocation-policy (GPUSLICE_SHARED_ALLOCATION_POLICY) instead"
    ),
    ("sharing", "timeSlicing", "resources", "*", "rename"): (
        "per-resource rename is not supported; use renameByDefault"
    ),
    ("sharing", "timeSlicing", "resources", "*", "devices"): (
        "device selection is not supported; replicas apply to every device of the resource"
    ),
    ("sharing", "mps", "resources", "*", "rename"): (
        "per-resource rename is not supported; use renameByDefault"
    ),
    ("sharing", "mps", "resources", "*", "devices"): (
        "device selection is not supported; replicas apply to every GPU of the resource"
    ),
}


class ConfigError(InvalidArgumentError):
    """The config file is malformed or uses a key this plugin refuses; the message names it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PluginFlags(_Strict):
    passDeviceSpecs: bool | None = None  # noqa: N815 - NVIDIA's key
    deviceListStrategy: ListStrategy | list[ListStrategy] | None = None  # noqa: N815
    deviceIDStrategy: IdStrategy | None = None  # noqa: N815


class Flags(_Strict):
    migStrategy: MigStrategy | None = None  # noqa: N815 - NVIDIA's key
    failOnInitError: bool | None = None  # noqa: N815
    plugin: PluginFlags = PluginFlags()


class ReplicatedResource(_Strict):
    name: Annotated[str, Field(min_length=1)]
    replicas: Annotated[int, Field(ge=2, le=1024)]

    @field_validator("name")
    @classmethod
    def _qualified(cls, value: str) -> str:
        return value if "/" in value else RESOURCE_PREFIX + value


def _no_duplicates(value: list[ReplicatedResource]) -> list[ReplicatedResource]:
    names = [r.name for r in value]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"resource {twice[0]!r} is listed more than once")
    return value


class TimeSlicing(_Strict):
    renameByDefault: bool = False  # noqa: N815 - NVIDIA's key
    failRequestsGreaterThanOne: bool = False  # noqa: N815
    resources: list[ReplicatedResource] = []

    @field_validator("resources")
    @classmethod
    def _unique(cls, value: list[ReplicatedResource]) -> list[ReplicatedResource]:
        return _no_duplicates(value)


class MpsSharing(_Strict):
    """``sharing.mps``: each GPU of a listed resource is split into ``replicas`` equal shares
    whose limits the enforcer holds (cores and memory / replicas). A container gets one
    replica: ``failRequestsGreaterThanOne`` is always true (NVIDIA forces it for MPS too), so
    ``false`` is refused rather than ignored."""

    renameByDefault: bool = False  # noqa: N815 - NVIDIA's key
    failRequestsGreaterThanOne: bool = True  # noqa: N815
    resources: list[ReplicatedResource] = []

    @field_validator("failRequestsGreaterThanOne")
    @classmethod
    def _one(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "must be true for MPS: a container is the client of one MPS share (one pipe"
                " directory), so a request for two replicas cannot be honoured"
            )
        return value

    @field_validator("resources")
    @classmethod
    def _unique(cls, value: list[ReplicatedResource]) -> list[ReplicatedResource]:
        for r in value:
            if r.replicas > MPS_MAX_CLIENTS:
                raise ValueError(
                    f"{r.name}: replicas {r.replicas} is more than the {MPS_MAX_CLIENTS} clients"
                    f" an MPS server takes per GPU; allowed 2..{MPS_MAX_CLIENTS}"
                )
        return _no_duplicates(value)


class Sharing(_Strict):
    timeSlicing: TimeSlicing = TimeSlicing()  # noqa: N815 - NVIDIA's key
    mps: MpsSharing = MpsSharing()

    @model_validator(mode="after")
    def _one_kind(self) -> Sharing:
        both = {r.name for r in self.timeSlicing.resources} & {r.name for r in self.mps.resources}
        if both:
            raise ValueError(
                f"resource {sorted(both)[0]!r} is listed under both timeSlicing and mps;"
                " a resource is shared one way"
            )
        return self


class ConfigFile(_Strict):
    version: Literal["v1"] = "v1"
    flags: Flags = Flags()
    sharing: Sharing = Sharing()


def _refuse_unsupported(data: Any, path: tuple[str, ...] = ()) -> list[str]:
    problems: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            here = (*path, str(key))
            pattern = tuple("*" if p.isdigit() else p for p in here)
            if pattern in UNSUPPORTED:
                problems.append(f"{strict.key_path(_loc(here))}: {UNSUPPORTED[pattern]}")
            else:
                problems += _refuse_unsupported(value, here)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            problems += _refuse_unsupported(item, (*path, str(i)))
    return problems


def _loc(path: tuple[str, ...]) -> strict.Loc:
    return tuple(int(p) if p.isdigit() else p for p in path)


def parse_config(text: str, *, source: str = "<config>") -> ConfigFile:
    """Decode the YAML (or JSON) text; ``ConfigError`` names every refused key."""
    data = strict.load_yaml(text, source=source, error=ConfigError)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping (version, flags, sharing)")
    if data.get("version") in ("", None):
        data = {**data, "version": "v1"}  # NVIDIA's rule: an empty version means v1
    refused = _refuse_unsupported(data)
    if refused:
        raise ConfigError(f"{source}: {'; '.join(refused)}")
    return strict.decode(ConfigFile, data, source=source, error=ConfigError)


def load_config_file(path: str | Path) -> ConfigFile:
    text = strict.read_text(path, what="device plugin config", error=ConfigError)
    return parse_config(text, source=str(path))


@dataclass(frozen=True)
class Settings:
    """The effective configuration: flags, then env, then the file, then the defaults."""

    mig_strategy: str = "none"
    fail_on_init_error: bool = True
    pass_device_specs: bool = False
    device_list_strategies: tuple[str, ...] = ("envvar",)
    device_id_strategy: str = "uuid"
    time_slicing: TimeSlicing = field(default_factory=TimeSlicing)
    mps: MpsSharing = field(default_factory=MpsSharing)
    #: Which config of a --config-dir this is ("" for --config-file or none).
    config_name: str = ""

    @property
    def cdi_only(self) -> bool:
        return all(s.startswith("cdi-") for s in self.device_list_strategies)


@dataclass(frozen=True)
class CommandLine:
    """The plugin's flags as given at start (``None``: not given, so the config file's value
    or the built-in default applies), frozen. ``cli`` makes it; every reload resolves the
    config against it again."""

    cdi_root: str
    cdi_spec: str
    config_dir: str | None
    config_file: str | None
    config_label: str
    config_poll_interval: float
    default_config: str | None
    device_id_strategy: str | None
    device_list_strategy: str | None
    device_plugins_dir: str
    driver_root: Path
    enforcer_socket: str | None
    fail_on_init_error: bool | None
    fake_nvml_config: str | None
    health_addr: str
    health_check_interval: float
    health_recovery: bool
    ignored_xids: frozenset[int]
    kubeconfig: str | None
    log_format: str
    log_level: str
    metrics_addr: str
    mig_strategy: str | None
    mode_check: bool
    node_name: str | None
    nvml: str
    pass_device_specs: bool | None
    pod_resources_socket: str
    shared_allocation_policy: str
    xid_quiet_period: float


def _pick(flag: Any, file: Any, default: Any) -> Any:
    if flag is not None:
        return flag
    return default if file is None else file


def resolve(args: CommandLine, file: ConfigFile | None, *, config_name: str = "") -> Settings:
    """Merge the parsed flags (``None`` = not given) with the config file."""
    f = file.flags if file is not None else Flags()
    list_strategy = _pick(args.device_list_strategy, f.plugin.deviceListStrategy, "envvar")
    if isinstance(list_strategy, str):
        list_strategy = [s.strip() for s in list_strategy.split(",") if s.strip()]
    for strategy in list_strategy:
        if strategy not in LIST_STRATEGIES:
            raise ConfigError(
                f"--device-list-strategy: {strategy!r} is not one of {', '.join(LIST_STRATEGIES)}"
            )
    return Settings(
        mig_strategy=_pick(args.mig_strategy, f.migStrategy, "none"),
        fail_on_init_error=_pick(args.fail_on_init_error, f.failOnInitError, True),
        pass_device_specs=_pick(args.pass_device_specs, f.plugin.passDeviceSpecs, False),
        device_list_strategies=tuple(dict.fromkeys(list_strategy)),
        device_id_strategy=_pick(args.device_id_strategy, f.plugin.deviceIDStrategy, "uuid"),
        time_slicing=file.sharing.timeSlicing if file is not None else TimeSlicing(),
        mps=file.sharing.mps if file is not None else MpsSharing(),
        config_name=config_name,
    )


@dataclass(frozen=True)
class Selected:
    """The config a node uses out of a directory of named configs, and why."""

    name: str
    config: ConfigFile
    why: str
    #: Other configs of the directory that do not decode (warnings: another node's problem).
    broken: tuple[str, ...] = ()


def config_names(directory: Path) -> list[str]:
    """The named configs: the regular files of the directory (a ConfigMap volume's keys;
    its ``..data`` links and dot files are not configs)."""
    if not directory.is_dir():
        raise ConfigError(f"--config-dir {directory}: no such directory")
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".") and p.is_file())


def select_config(
    directory: str | Path, *, label: str, label_value: str | None, default: str | None
) -> Selected:
    """Pick this node's config, NVIDIA's config-manager rules: the node label names it; without
    the label, ``default``; without a default, the only config there is. A label or default
    that names no config is an error listing the names; so is a selected config that does not
    decode (naming the key). Every other config is decoded too, and its problem is returned
    as a warning: one ConfigMap serves many nodes, and a typo should show up on all of them."""
    directory = Path(directory)
    names = config_names(directory)
    if not names:
        raise ConfigError(f"--config-dir {directory}: no configs in it")
    available = f"available: {', '.join(names)}"
    if label_value:
        name, why = label_value, f"node label {label}={label_value}"
    elif default:
        name, why = default, f"no node label {label}; the default config"
    elif len(names) == 1:
        name, why = names[0], f"no node label {label} and no default; the only config"
    else:
        raise ConfigError(
            f"--config-dir {directory}: the node has no label {label} and there is no"
            f" --default-config (GPUSLICE_DEFAULT_CONFIG) to fall back to; {available}"
        )
    if name not in names:
        raise ConfigError(f"{why}: no config named {name!r} in {directory}; {available}")
    broken: list[str] = []
    selected: ConfigFile | None = None
    for other in names:
        try:
            decoded = load_config_file(directory / other)
        except ConfigError as exc:
            if other == name:
                raise
            broken.append(str(exc))
            continue
        if other == name:
            selected = decoded
    assert selected is not None
    return Selected(name, selected, why, tuple(broken))
