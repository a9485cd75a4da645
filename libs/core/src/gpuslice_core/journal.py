"""A checkpoint whose commits append to a journal instead of rewriting the whole state.

:class:`CheckpointStore` rewrites (serialises, checksums, fsyncs) the whole state on every
commit, so a commit costs O(state). :class:`JournaledStore` keeps the same base file (same
envelope, same checks) and appends each commit's changes to ``<name>.journal`` as one
checksummed line, fdatasynced; the base is rewritten only every ``compact_lines`` commits
(compaction), when it is missing, or when it was migrated. A commit then costs O(change).

The state must keep its records in one ``dict[str, BaseModel]`` field (``records``); a
transaction changes records with ``put``/``delete`` and never mutates a record in place (the
previous snapshot, which readers may hold, shares the record objects).

Journal file: lines of ``sha256:<hex> <canonical JSON>``::

    sha256:… {"base":"<base checksum>","bootId":…,"kind":…,"schemaVersion":N}
    sha256:… {"ops":[{"put":"<key>","value":{…}},{"delete":"<key>"}],"seq":1}
    …

- The header names the checksum of the base it applies to: a journal whose base was since
  replaced (a crash after compaction wrote the new base, before the journal was removed) is
  stale and ignored (its changes are in the base). Its kind, boot id and schema version must be
  the base's.
- The header's checksum is the SHA-256 of its JSON; each later line's is the SHA-256 of the
  base's checksum, a newline and the line's JSON, which ties the line to its base (hashing the
  bytes as written keeps a full read cheap). ``seq`` counts from 1 without gaps. A line is
  appended with one ``write`` and then fdatasynced, and only then is the commit acknowledged.
- A last line without its newline is an append that was cut short (kill -9 inside ``write``):
  never acknowledged, so it is dropped, and cut off before the next append. Any complete line
  that does not parse, has a wrong checksum or breaks the sequence is corruption
  (:class:`CorruptStateError`, the file left as it is), like a bad base.
- The journal is created whole (temp file, fsync, rename, directory fsync), so its header is
  never torn. Compaction writes the base atomically, then removes the journal.

Boot id, versions, locking and corruption follow the base store (docs/checkpoint.md); a
previous boot's journal is set aside with its base (``<name>.journal.stale-<bootid>``).
Because an older build would read the base without its journal and lose changes, a store
that adopts the journal must bump its schema version (rule 3 then keeps older builds off).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic

from pydantic import BaseModel, ValidationError

from gpuslice_core.checkpoint import (
    CheckpointStore,
    LoadResult,
    Migration,
    ModelT,
    checksum,
)
from gpuslice_core.errors import CorruptStateError, InvalidArgumentError
from gpuslice_core.files import TEMP_SUFFIX, fsync_dir, temp_files_for
from gpuslice_core.strict import describe_errors

HEADER_KEYS = ("base", "bootId", "kind", "schemaVersion")
LINE_KEYS = ("ops", "seq")

Identity = tuple[tuple[int, int, int] | None, tuple[int, int] | None]


def _canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _digest(*parts: bytes) -> bytes:
    return b"sha256:" + hashlib.sha256(b"\n".join(parts)).hexdigest().encode("ascii")


class Txn(Generic[ModelT]):
    """One transaction's view: ``state`` (a fresh snapshot) and the changes to its records."""

    def __init__(self, state: ModelT, records: str) -> None:
        self.state = state
        self._records: dict[str, BaseModel] = getattr(state, records)
        self.changed: dict[str, BaseModel | None] = {}

    def put(self, key: str, record: BaseModel) -> None:
        """Store ``record`` under ``key`` (a new object: records are never changed in place)."""
        self._records[key] = record
        self.changed[key] = record

    def delete(self, key: str) -> None:
        if key in self._records:
            del self._records[key]
            self.changed[key] = None


@dataclass(frozen=True)
class _Loaded(Generic[ModelT]):
    result: LoadResult[ModelT]
    base_checksum: str | None  # None: no base file
    offset: int  # end of the journal's last complete line (0: no usable journal)
    seq: int
    identity: Identity


class JournaledStore(Generic[ModelT]):
    """A :class:`CheckpointStore` base plus an append-only journal; see the module doc."""

    def __init__(
        self,
        path: Path | str,
        *,
        kind: str,
        model: type[ModelT],
        schema_version: int,
        records: str,
        migrations: Mapping[int, Migration] | None = None,
        boot_id: str | None = None,
        lock_timeout: float = 10.0,
        compact_lines: int = 1024,
    ) -> None:
        field = model.model_fields.get(records)
        if field is None:
            raise InvalidArgumentError(f"checkpoint {kind}: {model.__name__} has no {records!r}")
        self.base = CheckpointStore(
            path,
            kind=kind,
            model=model,
            schema_version=schema_version,
            migrations=migrations,
            boot_id=boot_id,
            lock_timeout=lock_timeout,
        )
        self.records = records
        self.compact_lines = max(1, compact_lines)
        self.journal_path = self.base.path.with_name(self.base.path.name + ".journal")
        self._cached: _Loaded[ModelT] | None = None
        # held while this process changes the files and the cache together: a reader that
        # sees files newer than the cache waits for it instead of loading them again
        self._writing = threading.Lock()

    @property
    def path(self) -> Path:
        return self.base.path

    # ---- reading ---------------------------------------------------------------------------
    def _identity(self) -> Identity:
        try:
            st = self.base.path.stat()
            base: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            base = None
        try:
            jt = self.journal_path.stat()
            journal: tuple[int, int] | None = (jt.st_ino, jt.st_size)
        except FileNotFoundError:
            journal = None
        return base, journal

    def load(self) -> LoadResult[ModelT]:
        """Base plus journal, without the lock (a previous boot's files are set aside)."""
        return self._load(locked=False).result

    def read(self) -> ModelT:
        """The committed state, READ-ONLY; a ``stat`` of both files unless they changed."""
        cached = self._cached
        if cached is not None and cached.identity == self._identity():
            return cached.result.state
        with self._writing:  # our own write in progress? then the cache is current after it
            cached = self._cached
            if cached is not None and cached.identity == self._identity():
                return cached.result.state
            loaded = self._load(locked=False)  # another process wrote: read the files
            self._cached = loaded
            return loaded.result.state

    def _load(self, *, locked: bool) -> _Loaded[ModelT]:
        base = self.base
        identity = self._identity()
        doc = base._decode()
        if doc is None:
            empty = LoadResult(state=base._model(), existed=False)
            return _Loaded(empty, None, 0, 0, identity)
        if doc["bootId"] != base.boot_id:
            if not locked:
                with base._locked():
                    return self._load(locked=True)
            self._set_journal_aside(doc["bootId"])
            return _Loaded(base._set_aside(doc["bootId"]), None, 0, 0, self._identity())
        version: int = doc["schemaVersion"]
        if version > base._version:
            base._load(locked=True)  # raises the newer-version error, in the store's words
        data: dict[str, Any] = doc["data"]
        offset, seq = self._replay(doc, data)
        result = base._state_of(data, version, what="the base with its journal")
        return _Loaded(result, doc["checksum"], offset, seq, identity)

    def _corrupt(self, what: str) -> CorruptStateError:
        return CorruptStateError(
            f"checkpoint journal {self.journal_path} is unusable: {what}; the files were left "
            "untouched for inspection (move the checkpoint and its journal aside to start with "
            "empty state)"
        )

    def _replay(self, doc: dict[str, Any], data: dict[str, Any]) -> tuple[int, int]:
        """Apply the journal's changes to ``data``; (end of the last complete line, last seq)."""
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            return 0, 0
        lines = raw.split(b"\n")
        # lines[-1] is b"" after a final newline, else an append cut short (dropped)
        complete = lines[:-1]
        if not complete:
            return 0, 0
        header = self._parse(complete[0], 1, HEADER_KEYS, b"")
        if header["base"] != doc["checksum"]:
            return 0, 0  # stale: written before the base was compacted; its changes are in it
        base_checksum = str(doc["checksum"]).encode("ascii")
        for key in ("kind", "bootId", "schemaVersion"):
            if header[key] != doc[key]:
                raise self._corrupt(
                    f"line 1 (header): {key} {header[key]!r} is not the base's {doc[key]!r}"
                )
        records = data.setdefault(self.records, {})
        if not isinstance(records, dict):
            raise self._corrupt(f"the base's {self.records!r} is not an object")
        offset = len(complete[0]) + 1
        seq = 0
        for number, line in enumerate(complete[1:], start=2):
            entry = self._parse(line, number, LINE_KEYS, base_checksum)
            if entry["seq"] != seq + 1:
                raise self._corrupt(f"line {number}: seq {entry['seq']!r}, expected {seq + 1}")
            for op in entry["ops"]:
                self._apply(records, op, number)
            seq = entry["seq"]
            offset += len(line) + 1
        return offset, seq

    def _parse(
        self, line: bytes, number: int, keys: tuple[str, ...], base_checksum: bytes
    ) -> dict[str, Any]:
        said, _, payload = line.partition(b" ")
        actual = _digest(base_checksum, payload) if base_checksum else _digest(payload)
        if said != actual:
            raise self._corrupt(
                f"line {number}: checksum mismatch (line says {said[:80]!r}, content hashes "
                f"to {actual.decode()})"
            )
        try:
            obj = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._corrupt(f"line {number}: not valid JSON ({exc})") from exc
        if not isinstance(obj, dict) or sorted(obj) != sorted(keys):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise self._corrupt(f"line {number}: expected keys {sorted(keys)}, got {got}")
        return obj

    def _apply(self, records: dict[str, Any], op: Any, number: int) -> None:
        if isinstance(op, dict) and set(op) == {"put", "value"} and isinstance(op["put"], str):
            records[op["put"]] = op["value"]
        elif isinstance(op, dict) and set(op) == {"delete"} and isinstance(op["delete"], str):
            records.pop(op["delete"], None)
        else:
            raise self._corrupt(f"line {number}: bad operation {op!r}")

    def _set_journal_aside(self, file_boot_id: str) -> None:
        if self.journal_path.exists():
            suffix = self.base.stale_path_for(file_boot_id).name[len(self.base.path.name) :]
            self.journal_path.replace(self.journal_path.with_name(self.journal_path.name + suffix))

    # ---- writing ---------------------------------------------------------------------------
    def save(self, state: ModelT) -> None:
        """Replace the stored state with ``state`` (a new base; the journal is dropped)."""
        with self.base._locked(), self._writing:
            self._compact(state)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Txn[ModelT]]:
        """Lock, bring the state up to date, let the caller ``put``/``delete`` records, then
        append the changes (one line, fdatasynced). Nothing is written when the body raises or
        changed nothing (and the files are current)."""
        with self.base._locked():
            current = self._cached
            if current is None or current.identity != self._identity():
                current = self._load(locked=True)
                self._cached = current
            state = current.result.state
            records = dict(getattr(state, self.records))
            txn = Txn(state.model_copy(update={self.records: records}), self.records)
            yield txn
            rewrite = (
                not current.result.existed
                or current.result.migrated_from is not None
                or current.base_checksum is None
            )
            with self._writing:
                if rewrite or current.seq + 1 >= self.compact_lines:
                    self._compact(txn.state)
                elif txn.changed:
                    self._append(current, txn)

    def _compact(self, state: ModelT) -> None:
        self.base._write(state)
        self.journal_path.unlink(missing_ok=True)
        fsync_dir(self.base.path.parent)
        self._cached = self._load(locked=True)

    def _ops(self, txn: Txn[ModelT]) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = []
        for key, record in txn.changed.items():
            if record is None:
                ops.append({"delete": key})
                continue
            value = record.model_dump(mode="json", warnings=False)
            try:  # records are not validated on assignment: check before persisting
                type(record).model_validate(value)
            except ValidationError as exc:
                raise InvalidArgumentError(
                    f"checkpoint {self.base.path}: refusing to write an invalid record {key}: "
                    f"{describe_errors(exc)}"
                ) from exc
            ops.append({"put": key, "value": value})
        return ops

    def _append(self, current: _Loaded[ModelT], txn: Txn[ModelT]) -> None:
        base_checksum = current.base_checksum
        assert base_checksum is not None
        seq = current.seq + 1
        ops = self._ops(txn)
        payload = _canonical({"ops": ops, "seq": seq})
        line = _digest(base_checksum.encode("ascii"), payload) + b" " + payload + b"\n"
        if current.offset == 0:
            offset = self._create(base_checksum, line)
        else:
            fd = os.open(self.journal_path, os.O_WRONLY)
            try:
                os.ftruncate(fd, current.offset)  # an append cut short is never acknowledged
                _write_all(fd, line, current.offset)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            offset = current.offset + len(line)
        result = LoadResult(state=txn.state, existed=True)
        self._cached = _Loaded(result, base_checksum, offset, seq, self._identity())

    def _create(self, base_checksum: str, line: bytes) -> int:
        """A new journal (header and first line), atomically: its header is never torn.
        Returns its size."""
        base = self.base
        header: dict[str, Any] = {
            "base": base_checksum,
            "bootId": base.boot_id,
            "kind": base._kind,
            "schemaVersion": base._version,
        }
        encoded = _canonical(header)
        payload = _digest(encoded) + b" " + encoded + b"\n" + line
        path = self.journal_path
        for leftover in temp_files_for(path):  # safe: every writer holds the lock
            leftover.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, payload, 0)
            os.fsync(fd)
            os.close(fd)
            Path(tmp).replace(path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
        return len(payload)


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


__all__ = ["JournaledStore", "Txn", "checksum"]
