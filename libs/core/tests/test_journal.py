"""Tests for gpuslice_core.journal: commits append, compaction, a crash at each step, SIGKILL at
random moments, old-version files, corruption, boot id."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gpuslice_core.checkpoint import CheckpointStore
from gpuslice_core.errors import CorruptStateError, InvalidArgumentError
from gpuslice_core.files import temp_files_for
from gpuslice_core.journal import JournaledStore

from .test_checkpoint import BOOT_A, BOOT_B, read_line, reap, spawn

pytestmark = pytest.mark.timeout(30)


class Rec(BaseModel):
    value: int = 0
    note: str = ""


class State(BaseModel):
    recs: dict[str, Rec] = {}


def journaled(path: Path, boot_id: str = BOOT_A, **kwargs: Any) -> JournaledStore[State]:
    kwargs.setdefault("schema_version", 2)
    kwargs.setdefault("migrations", {1: lambda data: data})
    return JournaledStore(path, kind="recs", model=State, records="recs", boot_id=boot_id, **kwargs)


def put(store: JournaledStore[State], key: str, value: int) -> None:
    with store.transaction() as txn:
        txn.put(key, Rec(value=value))


def values(store: JournaledStore[State]) -> dict[str, int]:
    fresh = journaled(store.path, store.base.boot_id, compact_lines=store.compact_lines)
    return {k: r.value for k, r in fresh.load().state.recs.items()}


def journal_lines(store: JournaledStore[State]) -> list[dict[str, Any]]:
    """The JSON of each line (after its ``sha256:<hex>`` checksum)."""
    lines = store.journal_path.read_bytes().splitlines()
    return [json.loads(x.partition(b" ")[2]) for x in lines]


def test_commits_append_one_line_each_and_a_new_reader_sees_them(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 1)  # no base yet: the first commit writes it
    base = store.path.read_bytes()
    put(store, "b", 2)
    put(store, "a", 3)
    with store.transaction() as txn:
        txn.delete("b")
        txn.put("c", Rec(value=4))
    assert store.path.read_bytes() == base  # the base is not rewritten per commit
    header, *lines = journal_lines(store)
    assert header["base"] == json.loads(base)["checksum"]
    assert [line["seq"] for line in lines] == [1, 2, 3]
    assert lines[2]["ops"] == [{"delete": "b"}, {"put": "c", "value": {"value": 4, "note": ""}}]
    assert values(store) == {"a": 3, "c": 4}
    assert store.read().recs["a"].value == 3


def test_an_unchanged_transaction_writes_nothing(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 1)
    put(store, "b", 1)
    size = store.journal_path.stat().st_size
    with store.transaction() as txn:
        assert txn.state.recs["a"].value == 1
    assert store.journal_path.stat().st_size == size


def test_a_failed_body_writes_nothing_and_readers_keep_their_snapshot(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 1)
    snapshot = store.read()
    with pytest.raises(RuntimeError), store.transaction() as txn:
        txn.put("a", Rec(value=2))
        raise RuntimeError("changed my mind")
    assert snapshot.recs["a"].value == 1
    assert values(store) == {"a": 1}
    put(store, "a", 3)
    assert snapshot.recs["a"].value == 1  # a new snapshot per commit
    assert store.read().recs["a"].value == 3


def test_compaction_rewrites_the_base_and_drops_the_journal(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json", compact_lines=4)
    for i in range(10):
        put(store, f"k{i}", i)
        assert values(store) == {f"k{j}": j for j in range(i + 1)}
        if store.journal_path.exists():
            assert len(journal_lines(store)) <= 4
    doc = json.loads(store.path.read_bytes())
    assert doc["schemaVersion"] == 2
    assert len(doc["data"]["recs"]) >= 8  # compacted at least once since


def test_invalid_record_is_refused_and_nothing_written(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 1)
    put(store, "b", 1)
    before = store.journal_path.read_bytes()
    with pytest.raises(InvalidArgumentError, match="record a"), store.transaction() as txn:
        txn.put("a", Rec.model_construct(value="many", note=""))
    assert store.journal_path.read_bytes() == before
    assert values(store) == {"a": 1, "b": 1}


# ---- a crash at each step ------------------------------------------------------------------
def test_crash_inside_an_append_drops_the_torn_line_and_the_next_append_cuts_it(
    tmp_path: Path,
) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 1)
    put(store, "b", 2)
    whole = store.journal_path.read_bytes()
    put(store, "c", 3)
    line = store.journal_path.read_bytes()[len(whole) :]
    for cut in (1, len(line) // 2, len(line) - 1):  # killed inside write(): no newline yet
        store.journal_path.write_bytes(whole + line[:cut])
        assert values(store) == {"a": 1, "b": 2}  # never acknowledged, so never there
        other = journaled(store.path)
        put(other, "d", 4)
        assert values(store) == {"a": 1, "b": 2, "d": 4}
        assert all(journal_lines(store))
        store.journal_path.write_bytes(whole)


def test_crash_before_the_new_journal_is_renamed_leaves_the_state_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 1)  # base only

    def crash(self: Path, target: Any) -> Path:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(Path, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        put(store, "b", 2)
    monkeypatch.undo()
    assert not store.journal_path.exists()
    assert values(store) == {"a": 1}
    put(journaled(store.path), "c", 3)  # a temp file left by a crash does not get in the way
    assert values(store) == {"a": 1, "c": 3}
    assert temp_files_for(store.journal_path) == []


def test_crash_between_compaction_and_removing_the_journal(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json", compact_lines=3)
    put(store, "a", 1)
    put(store, "b", 2)
    put(store, "c", 3)
    old_journal = store.journal_path.read_bytes()
    put(store, "a", 9)  # compacts: new base, journal removed
    assert not store.journal_path.exists()
    store.journal_path.write_bytes(old_journal)  # as if killed before the unlink
    assert values(store) == {"a": 9, "b": 2, "c": 3}  # the old journal names the old base
    put(journaled(store.path, compact_lines=3), "d", 4)  # and is replaced by a new one
    assert values(store) == {"a": 9, "b": 2, "c": 3, "d": 4}
    assert journal_lines(store)[0]["base"] == json.loads(store.path.read_bytes())["checksum"]


KILL_WRITER = """
    import os
    import sys
    from pathlib import Path
    from pydantic import BaseModel
    from gpuslice_core.journal import JournaledStore

    class Rec(BaseModel):
        value: int = 0
        note: str = ""

    class State(BaseModel):
        recs: dict[str, Rec] = {}

    store = JournaledStore(Path(sys.argv[1]), kind="kill-test", model=State, records="recs",
                           schema_version=1, boot_id=sys.argv[2], compact_lines=16)
    for line in sys.stdin:  # one forked writer per line; the test SIGKILLs it
        pid = os.fork()
        if pid == 0:
            print(f"ready {os.getpid()}", flush=True)
            while True:
                with store.transaction() as txn:
                    last = txn.state.recs.get("last", Rec()).value + 1
                    txn.put(f"k{last % 7}", Rec(value=last, note="x" * 2000))
                    txn.put("last", Rec(value=last))
        _, status = os.waitpid(pid, 0)
        print(f"reaped {status}", flush=True)
"""


@pytest.mark.timeout(60)
def test_sigkill_at_random_moments_never_loses_or_tears_a_commit(tmp_path: Path) -> None:
    path = tmp_path / "kill.json"
    rng = random.Random(20261124)
    last = 0
    proc = spawn(KILL_WRITER, str(path), BOOT_A)
    assert proc.stdin is not None
    try:
        for _ in range(12):
            proc.stdin.write(b"go\n")
            word, pid = read_line(proc, timeout=20).split()
            assert word == "ready"
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(int(pid), signal.SIGKILL)
            assert read_line(proc, timeout=10) == f"reaped {signal.SIGKILL}"
            store = JournaledStore(
                path,
                kind="kill-test",
                model=State,
                records="recs",
                schema_version=1,
                boot_id=BOOT_A,
            )
            recs = store.load().state.recs  # raises CorruptStateError on a torn commit
            now = recs["last"].value if "last" in recs else 0
            assert now >= last, "a committed change was lost"
            for k in range(7):  # every key holds the newest value written for it: whole batches
                newest = max((v for v in range(1, now + 1) if v % 7 == k), default=None)
                assert (recs[f"k{k}"].value if f"k{k}" in recs else None) == newest
            last = now
        proc.stdin.close()
    finally:
        reap(proc)
    assert last > 0


# ---- versions, corruption, boot id ---------------------------------------------------------
def test_a_version_1_file_without_journal_is_read_and_rewritten_in_version_2(
    tmp_path: Path,
) -> None:
    old = CheckpointStore(
        tmp_path / "s.json", kind="recs", model=State, schema_version=1, boot_id=BOOT_A
    )
    old.save(State(recs={"a": Rec(value=1)}))
    store = journaled(old.path)
    loaded = store.load()
    assert loaded.migrated_from == 1
    assert {k: r.value for k, r in loaded.state.recs.items()} == {"a": 1}
    put(store, "b", 2)
    assert json.loads(store.path.read_bytes())["schemaVersion"] == 2
    assert values(store) == {"a": 1, "b": 2}
    # and a version-1 build refuses what it would only half understand, never overwriting it
    with pytest.raises(CorruptStateError, match="newer than the 1"):
        old.load()


def test_newer_version_is_refused(tmp_path: Path) -> None:
    put(journaled(tmp_path / "s.json", schema_version=3, migrations={}), "a", 1)
    with pytest.raises(CorruptStateError, match="newer than the 2"):
        journaled(tmp_path / "s.json").load()


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b.replace(b'"value":2', b'"value":7'), "line 3: checksum mismatch"),
        (lambda b: b.replace(b"\n", b"\nsha256:00 ", 1), "line 2: checksum mismatch"),
        (lambda b: b + b"sha256:" + b"0" * 64 + b" {}\n", "line 4: checksum mismatch"),
    ],
)
def test_a_damaged_complete_line_is_corruption_naming_the_line(
    tmp_path: Path, mangle: Any, message: str
) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 0)
    put(store, "a", 1)
    put(store, "b", 2)
    before = mangle(store.journal_path.read_bytes())
    store.journal_path.write_bytes(before)
    with pytest.raises(CorruptStateError, match=message) as info:
        journaled(store.path).load()
    assert str(store.journal_path) in str(info.value)
    with pytest.raises(CorruptStateError):  # nor is it written over
        put(journaled(store.path), "c", 3)
    assert store.journal_path.read_bytes() == before


def test_a_header_of_another_boot_is_corruption(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json")
    put(store, "a", 0)
    put(store, "a", 1)
    header, rest = store.journal_path.read_bytes().split(b"\n", 1)
    doc = json.loads(header.partition(b" ")[2])
    doc["bootId"] = BOOT_B
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    checksum = b"sha256:" + hashlib.sha256(payload).hexdigest().encode()
    store.journal_path.write_bytes(checksum + b" " + payload + b"\n" + rest)
    with pytest.raises(CorruptStateError, match=r"line 1 \(header\): bootId"):
        journaled(store.path).load()


def test_previous_boot_base_and_journal_are_set_aside_together(tmp_path: Path) -> None:
    store = journaled(tmp_path / "s.json", boot_id=BOOT_A)
    put(store, "a", 0)
    put(store, "b", 1)
    later = journaled(store.path, boot_id=BOOT_B)
    loaded = later.load()
    assert loaded.state.recs == {}
    assert loaded.stale_path is not None and loaded.stale_path.exists()
    assert not store.journal_path.exists()
    assert list(tmp_path.glob("s.json.journal.stale-*"))
    put(later, "c", 2)
    assert values(later) == {"c": 2}
