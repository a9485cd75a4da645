"""Tests for gpuslice_core.checkpoint: format, atomicity under SIGKILL, versions, boot id, lock."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gpuslice_core import checkpoint as cp
from gpuslice_core.checkpoint import CheckpointStore, read_boot_id
from gpuslice_core.errors import CorruptStateError, InvalidArgumentError, TransientError
from gpuslice_core.files import temp_files_for

BOOT_A = "0d6e4c1a-8a8c-4d2e-9b1f-aaaaaaaaaaaa"
BOOT_B = "5f0c2b7e-1c3d-4e5f-8a9b-bbbbbbbbbbbb"


class Claims(BaseModel):
    claims: dict[str, list[str]] = {}
    generation: int = 0


class Payload(BaseModel):
    version: int = 0
    payload: str = ""


def store_at(path: Path, boot_id: str = BOOT_A, **kwargs: Any) -> CheckpointStore[Claims]:
    return CheckpointStore(
        path, kind="kubelet-plugin", model=Claims, schema_version=1, boot_id=boot_id, **kwargs
    )


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line from the child's stdout, failing the test after ``timeout`` seconds."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(remaining, 0))
        if not ready:
            pytest.fail(f"child printed no line within {timeout}s (got {buf!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            pytest.fail(f"child exited (rc={proc.wait()}) before printing a line (got {buf!r})")
        buf += chunk
    return buf.decode().strip()


def reap(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` and wait for it, bounded."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def spawn(script: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        bufsize=0,
    )


def test_round_trip_and_file_format(tmp_path: Path) -> None:
    path = tmp_path / "state" / "plugin.json"
    store = store_at(path)
    assert store.load().existed is False
    store.save(Claims(claims={"uid-1": ["gpu-0"]}, generation=3))

    result = store.load()
    assert result.existed and not result.discarded_stale and result.migrated_from is None
    assert result.state == Claims(claims={"uid-1": ["gpu-0"]}, generation=3)
    doc = json.loads(path.read_text())
    assert list(doc) == ["kind", "schemaVersion", "bootId", "checksum", "data"]
    assert doc["kind"] == "kubelet-plugin" and doc["schemaVersion"] == 1
    assert doc["bootId"] == BOOT_A and doc["checksum"].startswith("sha256:")
    assert doc["checksum"] == cp.checksum("kubelet-plugin", 1, BOOT_A, doc["data"])
    assert path.stat().st_mode & 0o777 == 0o600


def test_transaction_writes_on_success_only(tmp_path: Path) -> None:
    store = store_at(tmp_path / "s.json")
    with store.transaction() as state:
        state.claims["uid-1"] = ["gpu-0"]
    with pytest.raises(RuntimeError), store.transaction() as state:
        state.claims["uid-2"] = ["gpu-1"]
        raise RuntimeError("prepare failed half way")
    assert store.load().state.claims == {"uid-1": ["gpu-0"]}


def test_unchanged_transaction_does_not_rewrite(tmp_path: Path) -> None:
    store = store_at(tmp_path / "s.json")
    store.save(Claims(generation=1))
    inode = store.path.stat().st_ino
    with store.transaction() as state:
        assert state.generation == 1
    assert store.path.stat().st_ino == inode


def test_invalid_mutation_is_refused_and_nothing_written(tmp_path: Path) -> None:
    store = store_at(tmp_path / "s.json")
    store.save(Claims(generation=1))
    before = store.path.read_bytes()
    with pytest.raises(InvalidArgumentError, match="generation"), store.transaction() as state:
        state.generation = "many"  # type: ignore[assignment]
    assert store.path.read_bytes() == before


KILL_WRITER = """
    import os
    import sys
    from pathlib import Path
    from pydantic import BaseModel
    from gpuslice_core.checkpoint import CheckpointStore

    class Payload(BaseModel):
        version: int = 0
        payload: str = ""

    store = CheckpointStore(Path(sys.argv[1]), kind="kill-test", model=Payload,
                            schema_version=1, boot_id=sys.argv[2])
    size = int(sys.argv[3])
    # One writer process per line on stdin (forked, so the imports are paid once). The writer
    # goes on from the given version until the test SIGKILLs it; then this loop reaps it.
    for line in sys.stdin:
        start = int(line)
        pid = os.fork()
        if pid == 0:
            with store.transaction() as state:  # goes on from what the last kill left
                assert state.version == start - 1, (state.version, start)
                state.version = start
                state.payload = f"{start:08d}" * (size // 8)
            print(f"ready {os.getpid()}", flush=True)
            for v in range(start + 1, start + 1_000_000):
                store.save(Payload(version=v, payload=f"{v:08d}" * (size // 8)))
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {status}", flush=True)
"""


@pytest.mark.timeout(60)
def test_sigkill_at_random_moments_never_tears_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kill.json"
    store = CheckpointStore(path, kind="kill-test", model=Payload, schema_version=1, boot_id=BOOT_A)
    size = 2 * 1024 * 1024
    rng = random.Random(20240611)
    last = 0
    interrupted = 0
    rounds = 12
    proc = spawn(KILL_WRITER, str(path), BOOT_A, str(size))
    assert proc.stdin is not None
    try:
        for _ in range(rounds):
            proc.stdin.write(f"{last + 1}\n".encode())
            word, pid = read_line(proc, timeout=20).split()
            assert word == "ready"
            time.sleep(rng.uniform(0.0, 0.1))
            os.kill(int(pid), signal.SIGKILL)
            assert read_line(proc, timeout=10) == f"reaped {signal.SIGKILL}"
            interrupted += bool(temp_files_for(path))
            state = store.load().state  # raises CorruptStateError on a torn file
            assert state.version > last, "a completed write was lost"
            assert state.payload == f"{state.version:08d}" * (size // 8)
            last = state.version
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    finally:
        reap(proc)
    print(f"kills that interrupted a write: {interrupted}/{rounds}")
    store.save(Payload(version=last + 1))  # leftovers of killed writers do not get in the way
    assert temp_files_for(path) == []
    assert store.load().state.version == last + 1


def test_crash_between_fsync_and_replace_keeps_old_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_at(tmp_path / "s.json")
    store.save(Claims(generation=1))

    def crash(self: Path, target: Any) -> Path:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(Path, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        store.save(Claims(generation=2))
    monkeypatch.undo()
    assert store.load().state.generation == 1
    assert temp_files_for(store.path) == []


def test_flipped_byte_is_a_checksum_mismatch_naming_the_file(tmp_path: Path) -> None:
    store = store_at(tmp_path / "s.json")
    store.save(Claims(claims={"uid-1": ["gpu-0"]}))
    raw = store.path.read_bytes()
    flipped = raw.replace(b'"gpu-0"', b'"gpu-1"')
    store.path.write_bytes(flipped)
    with pytest.raises(CorruptStateError, match="checksum mismatch") as err:
        store.load()
    assert str(store.path) in str(err.value)
    with pytest.raises(CorruptStateError), store.transaction():
        pass
    assert store.path.read_bytes() == flipped  # left untouched for a human


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
        (lambda raw: b"", "not valid JSON"),
        (lambda raw: raw.replace(b"{", b"[", 1), "not valid JSON"),
        (lambda raw: b"[1, 2]", "not an object"),
        (lambda raw: bytes([raw[0] ^ 0xFF]) + raw[1:], "not valid JSON"),
    ],
)
def test_garbled_file_is_refused(tmp_path: Path, mangle: Any, message: str) -> None:
    store = store_at(tmp_path / "s.json")
    store.save(Claims(generation=5))
    broken = mangle(store.path.read_bytes())
    store.path.write_bytes(broken)
    with pytest.raises(CorruptStateError, match=message) as err:
        store.load()
    assert str(store.path) in str(err.value)
    assert store.path.read_bytes() == broken


def rewrite(path: Path, **changes: Any) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    doc = {k: v for k, v in doc.items() if v is not None}
    doc["checksum"] = cp.checksum(doc["kind"], doc["schemaVersion"], doc["bootId"], doc["data"])
    path.write_text(json.dumps(doc))


def test_wrong_kind_missing_keys_and_bad_data(tmp_path: Path) -> None:
    store = store_at(tmp_path / "s.json")
    store.save(Claims())
    rewrite(store.path, kind="mig-manager")
    with pytest.raises(CorruptStateError, match="kind is 'mig-manager'"):
        store.load()

    doc = json.loads(store.path.read_text())
    del doc["bootId"]
    store.path.write_text(json.dumps(doc))
    with pytest.raises(CorruptStateError, match=r"missing keys \['bootId'\]"):
        store.load()

    store.path.unlink()
    store.save(Claims())
    rewrite(store.path, data={"generation": "not a number"})
    with pytest.raises(CorruptStateError, match="generation"):
        store.load()


class ClaimsV2(BaseModel):
    prepared: dict[str, list[str]] = {}
    generation: int = 0


def v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {"prepared": data.get("claims", {}), "generation": data.get("generation", 0)}


def test_older_schema_is_migrated_and_rewritten_in_the_new_version(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    store_at(path).save(Claims(claims={"uid-1": ["gpu-0"]}, generation=7))
    v2 = CheckpointStore(
        path,
        kind="kubelet-plugin",
        model=ClaimsV2,
        schema_version=2,
        migrations={1: v1_to_v2},
        boot_id=BOOT_A,
    )
    result = v2.load()
    assert result.migrated_from == 1
    assert result.state == ClaimsV2(prepared={"uid-1": ["gpu-0"]}, generation=7)
    assert json.loads(path.read_text())["schemaVersion"] == 1  # load() writes nothing
    with v2.transaction():
        pass  # unchanged, but migrated: written back in version 2
    assert json.loads(path.read_text())["schemaVersion"] == 2
    assert v2.load().migrated_from is None


def test_missing_migration_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    store_at(path).save(Claims())
    v3 = CheckpointStore(
        path, kind="kubelet-plugin", model=ClaimsV2, schema_version=3, boot_id=BOOT_A
    )
    with pytest.raises(CorruptStateError, match="no migration from version 1"):
        v3.load()
    with pytest.raises(InvalidArgumentError, match="migrations"):
        CheckpointStore(
            path,
            kind="kubelet-plugin",
            model=ClaimsV2,
            schema_version=2,
            migrations={2: v1_to_v2},
            boot_id=BOOT_A,
        )


def test_newer_schema_is_refused_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    newer = CheckpointStore(
        path,
        kind="kubelet-plugin",
        model=ClaimsV2,
        schema_version=2,
        migrations={1: v1_to_v2},
        boot_id=BOOT_A,
    )
    newer.save(ClaimsV2(prepared={"uid-1": ["gpu-0"]}))
    before = path.read_bytes()
    older = store_at(path)
    with pytest.raises(CorruptStateError, match="schemaVersion 2, newer than the 1") as err:
        older.load()
    assert str(path) in str(err.value)
    with pytest.raises(CorruptStateError), older.transaction() as state:
        state.generation = 99
    assert path.read_bytes() == before


def test_previous_boot_state_is_set_aside_and_load_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    store_at(path, boot_id=BOOT_A).save(Claims(claims={"uid-1": ["gpu-0"]}))
    before = path.read_bytes()

    after_reboot = store_at(path, boot_id=BOOT_B)
    result = after_reboot.load()
    assert result.state == Claims() and not result.existed
    assert result.discarded_stale and result.stale_boot_id == BOOT_A
    assert result.stale_path == tmp_path / f"s.json.stale-{BOOT_A}"
    assert result.stale_path.read_bytes() == before  # kept, not deleted
    assert not path.exists()

    with after_reboot.transaction() as state:
        state.generation = 1
    assert json.loads(path.read_text())["bootId"] == BOOT_B
    assert after_reboot.load().state.generation == 1


def test_previous_boot_state_is_set_aside_inside_a_transaction(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    store_at(path, boot_id=BOOT_A).save(Claims(generation=4))
    with store_at(path, boot_id=BOOT_B).transaction() as state:
        assert state == Claims()
    assert (tmp_path / f"s.json.stale-{BOOT_A}").exists()


def test_read_boot_id(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text(BOOT_A + "\n")
    assert read_boot_id(boot) == BOOT_A
    with pytest.raises(Exception, match="cannot read the boot id"):
        read_boot_id(tmp_path / "missing")


def test_model_without_empty_state_is_refused(tmp_path: Path) -> None:
    class Needy(BaseModel):
        required: int

    with pytest.raises(InvalidArgumentError, match="empty state"):
        CheckpointStore(tmp_path / "s.json", kind="k", model=Needy, schema_version=1, boot_id="b")


LOCK_HOLDER = """
    import sys
    from pathlib import Path
    from pydantic import BaseModel
    from gpuslice_core.checkpoint import CheckpointStore

    class Claims(BaseModel):
        claims: dict[str, list[str]] = {}
        generation: int = 0

    store = CheckpointStore(Path(sys.argv[1]), kind="kubelet-plugin", model=Claims,
                            schema_version=1, boot_id=sys.argv[2])
    with store.transaction() as state:
        state.generation = 42
        print("locked", flush=True)
        sys.stdin.readline()
    print("released", flush=True)
"""


@pytest.mark.timeout(30)
def test_lock_excludes_a_second_process(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    proc = spawn(LOCK_HOLDER, str(path), BOOT_A)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert read_line(proc, timeout=20) == "locked"
        contender = store_at(path, lock_timeout=0.3)
        started = time.monotonic()
        with (
            pytest.raises(TransientError, match="held by another process"),
            contender.transaction(),
        ):
            pytest.fail("entered the transaction while another process held the lock")
        assert time.monotonic() - started >= 0.3
        assert contender.load().existed is False  # readers are not blocked by the lock

        proc.stdin.write(b"go\n")
        assert read_line(proc, timeout=10) == "released"
        assert proc.wait(timeout=10) == 0
        with store_at(path, lock_timeout=5).transaction() as state:
            assert state.generation == 42  # saw the holder's committed write
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()
