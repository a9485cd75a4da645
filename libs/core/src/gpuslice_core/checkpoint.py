"""Atomic, versioned, checksummed, boot-id-aware checkpoints of node state.

The kubelet plugin, the enforcer and the MIG manager keep their node state in one
:class:`CheckpointStore` each. A store is one JSON document::

    {"kind": "<store name>", "schemaVersion": N, "bootId": "<boot id>",
     "checksum": "sha256:<hex>", "data": {...}}

``checksum`` covers a canonical serialization (sorted keys, no whitespace, UTF-8) of
``kind``, ``schemaVersion``, ``bootId`` and ``data``. This envelope never changes;
``schemaVersion`` versions ``data`` only.

Writes are atomic: a temp file in the same directory is written, flushed and fsynced, then
``os.replace``-d over the checkpoint and the directory is fsynced. A reader therefore sees the
old or the new state, never a torn one, whenever the writer is killed. Temp files a killed
writer leaves behind are hidden (``.<name>.<random>.tmp``) and removed by the next write.

Compatibility rule (the checkpoint is a versioned API):

1. A compatible change keeps the version: adding a field that has a default. Builds of the same
   version read each other's files; a reader ignores fields it does not know (models must not
   forbid extra fields) and fills in defaults for fields the file lacks. An older build that
   rewrites the file drops the fields it does not know, so a field whose loss would do harm is
   not a compatible change.
2. Any other change (rename, removal, new meaning, new required field) is a new version N+1,
   shipped with a migration ``migrations[N]`` that turns a version-N ``data`` document into a
   version-N+1 one. A reader accepts its own version and every older version its chain of
   migrations reaches; it always writes its own version.
3. A file whose version is newer than the reader's is refused with :class:`CorruptStateError`
   and left untouched, by ``load`` and ``transaction`` alike: a downgraded build never
   overwrites state it cannot understand.

Boot id: every file records the boot it was written in (``/proc/sys/kernel/random/boot_id``).
Node state (prepared claims, MIG instances, MPS daemons) does not survive a reboot, so a file
from another boot is moved aside to ``<name>.stale-<bootid>`` (kept for a human, never
deleted) and ``load`` returns the empty state with ``LoadResult.stale_path`` set. The boot id is
checked after integrity (a corrupt file is refused whatever its boot) and before the version.

Corruption (bad JSON, checksum mismatch, wrong kind, missing keys, data that fails the model)
raises :class:`CorruptStateError` naming the file and the fault; the file is left untouched.

Locking: ``transaction()`` holds an exclusive cross-process lock (``<name>.lock``, flock via
filelock) for its whole read-modify-write. ``load()`` takes no lock: atomic replace makes plain
reads safe. See docs/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import filelock
import structlog
from pydantic import BaseModel, ValidationError

from gpuslice_core.errors import (
    CorruptStateError,
    FailedPreconditionError,
    InvalidArgumentError,
    TransientError,
)
from gpuslice_core.files import (
    atomic_write_bytes,
    fsync_dir,
    temp_files_for,
)
from gpuslice_core.strict import describe_errors

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
ENVELOPE_KEYS = ("kind", "schemaVersion", "bootId", "checksum", "data")

ModelT = TypeVar("ModelT", bound=BaseModel)
Migration = Callable[[dict[str, Any]], dict[str, Any]]

_log = structlog.get_logger("gpuslice.checkpoint")
_UNSAFE_FILENAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """Return the kernel's boot id, which changes on every boot."""
    try:
        boot_id = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise FailedPreconditionError(f"cannot read the boot id from {path}: {exc}") from exc
    if not boot_id:
        raise FailedPreconditionError(f"the boot id file {path} is empty")
    return boot_id


def checksum(kind: str, schema_version: int, boot_id: str, data: Mapping[str, Any]) -> str:
    """The ``sha256:<hex>`` checksum over the canonical form of a checkpoint's content."""
    canonical = json.dumps(
        {"bootId": boot_id, "data": data, "kind": kind, "schemaVersion": schema_version},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class LoadResult(Generic[ModelT]):
    """What :meth:`CheckpointStore.load` found; callers log the unusual outcomes."""

    state: ModelT
    existed: bool
    """A checkpoint of the current boot was read (False: missing, or stale and set aside)."""
    migrated_from: int | None = None
    """The file's older schema version when ``state`` was migrated from it."""
    stale_boot_id: str | None = None
    """The boot id of a previous boot's file that was discarded."""
    stale_path: Path | None = None
    """Where that previous boot's file was kept."""

    @property
    def discarded_stale(self) -> bool:
        return self.stale_path is not None


class CheckpointStore(Generic[ModelT]):
    """One checkpoint file whose ``data`` is validated by the pydantic model ``model``.

    ``model()`` (every field defaulted) is the empty state. ``migrations[n]`` converts a
    version-``n`` data dict into version ``n + 1``.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        kind: str,
        model: type[ModelT],
        schema_version: int,
        migrations: Mapping[int, Migration] | None = None,
        boot_id: str | None = None,
        lock_timeout: float = 10.0,
    ) -> None:
        if not kind:
            raise InvalidArgumentError("checkpoint kind must be a non-empty string")
        if schema_version < 1:
            raise InvalidArgumentError(f"schema_version must be >= 1, got {schema_version}")
        migrations = dict(migrations or {})
        bad = sorted(v for v in migrations if not 1 <= v < schema_version)
        if bad:
            raise InvalidArgumentError(
                f"checkpoint {kind}: migrations must be keyed by versions 1..{schema_version - 1}"
                f" (the version they migrate from), got {bad}"
            )
        self._path = Path(path)
        self._kind = kind
        self._model = model
        self._version = schema_version
        self._migrations = migrations
        self._boot_id = boot_id if boot_id is not None else read_boot_id()
        self._lock_timeout = lock_timeout
        self._lock_file: filelock.FileLock | None = None
        self._lock_pid = 0
        try:
            self._model()
        except ValidationError as exc:
            raise InvalidArgumentError(
                f"checkpoint {kind}: {model.__name__}() must build the empty state: "
                f"{describe_errors(exc)}"
            ) from exc

    @property
    def path(self) -> Path:
        return self._path

    @property
    def lock_path(self) -> Path:
        return self._path.with_name(self._path.name + ".lock")

    @property
    def boot_id(self) -> str:
        return self._boot_id

    def stale_path_for(self, boot_id: str) -> Path:
        safe = _UNSAFE_FILENAME_CHARS.sub("_", boot_id)[:64]
        return self._path.with_name(f"{self._path.name}.stale-{safe}")

    def load(self) -> LoadResult[ModelT]:
        """Read the state without taking the lock (a previous boot's file is set aside)."""
        return self._load(locked=False)

    def save(self, state: ModelT) -> None:
        """Replace the stored state with ``state`` under the lock."""
        with self._locked():
            self._write(state)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[ModelT]:
        """Lock, load, let the caller mutate the state, write it back atomically on success.

        Nothing is written when the body raises, or when the state is unchanged and already
        stored in the current boot and version.
        """
        with self._locked():
            result = self._load(locked=True)
            before = result.state.model_dump(mode="json", warnings=False)
            yield result.state
            after = result.state.model_dump(mode="json", warnings=False)
            if after == before and result.existed and result.migrated_from is None:
                return
            self._write(result.state, dumped=after)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        if self._lock_file is None or self._lock_pid != os.getpid():  # a forked child: new fd
            self._lock_file = filelock.FileLock(self.lock_path, timeout=self._lock_timeout)
            self._lock_pid = os.getpid()
        lock = self._lock_file
        try:
            lock.acquire()
        except filelock.Timeout as exc:
            raise TransientError(
                f"checkpoint {self._path}: lock {self.lock_path} is held by another process;"
                f" gave up after {self._lock_timeout}s"
            ) from exc
        try:
            yield
        finally:
            lock.release()

    def _corrupt(self, what: str) -> CorruptStateError:
        return CorruptStateError(
            f"checkpoint {self._path} is unusable: {what}; the file was left untouched for"
            " inspection (move it aside to start with empty state)"
        )

    def _decode(self) -> dict[str, Any] | None:
        try:
            raw = self._path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._corrupt(f"not valid JSON ({exc})") from exc
        if not isinstance(doc, dict):
            raise self._corrupt(f"top level is a JSON {type(doc).__name__}, not an object")
        missing = [key for key in ENVELOPE_KEYS if key not in doc]
        if missing:
            raise self._corrupt(f"missing keys {missing}")
        unknown = sorted(set(doc) - set(ENVELOPE_KEYS))
        if unknown:
            raise self._corrupt(f"unknown keys {unknown}")
        expected_types = {"kind": str, "bootId": str, "checksum": str, "data": dict}
        for key, typ in expected_types.items():
            if not isinstance(doc[key], typ):
                raise self._corrupt(f"{key} is {type(doc[key]).__name__}, not {typ.__name__}")
        version = doc["schemaVersion"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise self._corrupt(f"schemaVersion {version!r} is not a positive integer")
        actual = checksum(doc["kind"], version, doc["bootId"], doc["data"])
        if doc["checksum"] != actual:
            raise self._corrupt(
                f"checksum mismatch (file says {doc['checksum']}, content hashes to {actual})"
            )
        if doc["kind"] != self._kind:
            raise self._corrupt(f"kind is {doc['kind']!r}, this store holds {self._kind!r}")
        return doc

    def _load(self, *, locked: bool) -> LoadResult[ModelT]:
        doc = self._decode()
        if doc is None:
            return LoadResult(state=self._model(), existed=False)
        if doc["bootId"] != self._boot_id:
            if not locked:
                with self._locked():  # re-read: a writer may have replaced the file meanwhile
                    return self._load(locked=True)
            return self._set_aside(doc["bootId"])
        version: int = doc["schemaVersion"]
        if version > self._version:
            raise CorruptStateError(
                f"checkpoint {self._path} has schemaVersion {version}, newer than the"
                f" {self._version} this build understands; refusing to read or overwrite it."
                " Was gpuslice downgraded? Upgrade again, or move the file aside to start empty."
            )
        return self._state_of(doc["data"], version)

    def _state_of(
        self, data: dict[str, Any], version: int, *, what: str = "data"
    ) -> LoadResult[ModelT]:
        """``data`` of schema ``version`` (at most this build's), migrated and validated."""
        migrated_from = None
        if version < self._version:
            data = self._migrate(data, version)
            migrated_from = version
        try:
            state = self._model.model_validate(data)
        except ValidationError as exc:
            raise self._corrupt(
                f"{what} does not fit schema version {self._version} ({self._model.__name__}):"
                f" {describe_errors(exc)}"
            ) from exc
        return LoadResult(state=state, existed=True, migrated_from=migrated_from)

    def _migrate(self, data: dict[str, Any], version: int) -> dict[str, Any]:
        for step in range(version, self._version):
            migration = self._migrations.get(step)
            if migration is None:
                raise self._corrupt(
                    f"schemaVersion {version} is older than {self._version} and this build has"
                    f" no migration from version {step}"
                )
            try:
                data = migration(data)
            except Exception as exc:
                raise self._corrupt(f"migration from version {step} failed: {exc!r}") from exc
            if not isinstance(data, dict):
                raise self._corrupt(f"migration from version {step} returned a non-dict")
        return data

    def _set_aside(self, file_boot_id: str) -> LoadResult[ModelT]:
        stale = self.stale_path_for(file_boot_id)
        self._path.replace(stale)
        fsync_dir(self._path.parent)
        _log.warning(
            "checkpoint_stale_boot_discarded",
            path=str(self._path),
            kept_at=str(stale),
            file_boot_id=file_boot_id,
            boot_id=self._boot_id,
        )
        return LoadResult(
            state=self._model(), existed=False, stale_boot_id=file_boot_id, stale_path=stale
        )

    def _write(self, state: ModelT, *, dumped: dict[str, Any] | None = None) -> None:
        if not isinstance(state, self._model):
            raise InvalidArgumentError(
                f"checkpoint {self._path}: expected {self._model.__name__},"
                f" got {type(state).__name__}"
            )
        data = dumped if dumped is not None else state.model_dump(mode="json", warnings=False)
        try:  # mutations are not validated on assignment: check before persisting
            self._model.model_validate(data)
        except ValidationError as exc:
            raise InvalidArgumentError(
                f"checkpoint {self._path}: refusing to write invalid state: {describe_errors(exc)}"
            ) from exc
        doc = {
            "kind": self._kind,
            "schemaVersion": self._version,
            "bootId": self._boot_id,
            "checksum": checksum(self._kind, self._version, self._boot_id, data),
            "data": data,
        }
        # Compact: json's C encoder is used only without indent, and this is on the prepare
        # path (pipe the file through `python -m json.tool` to read it).
        payload = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n"
        for leftover in temp_files_for(self._path):  # safe: every writer holds the lock
            leftover.unlink(missing_ok=True)
        atomic_write_bytes(self._path, payload.encode("utf-8"))
