"""How the kubelet plugin's checkpoint costs grow with the claims prepared on the node
(issue 18: the cost curve, not one point). Prints figures; asserts nothing.

    .venv/bin/python bench/bench_checkpoint.py [--sizes 10,100,1000] [--commits 50]

For each size N the checkpoint holds N prepared share claims (one device each, with the
enforcer's edits, as prepare records them). Then, through the plugin's own Committer:

- commit: one prepare's commit (add a claim record: one journal line, checksummed and
  fdatasynced; every ``compact_lines`` commits the base is rewritten whole, which the p99
  shows when a compaction falls into the sample);
- compaction: rewriting the base with N claims (what every commit cost before the journal);
- read: the committed state as prepare's idempotence check reads it, after another writer
  changed the files (the cache misses: a full load of base and journal, and validation);
- size of the base file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from gpuslice_core.journal import Txn
from gpuslice_kubelet_plugin.checkpoint import (
    ClaimRecord,
    Committer,
    DeviceRecord,
    PluginState,
    open_store,
)

GIB = 1024**3


def claim(i: int) -> ClaimRecord:
    uid = str(uuid.uuid4())
    return ClaimRecord(
        uid=uid,
        namespace="bench",
        name=f"claim-{i}",
        state="PrepareCompleted",
        owner="bench",
        devices=[
            DeviceRecord(
                request="gpu",
                pool="node-a",
                device=f"gpu-{i % 8}",
                share_id=uuid.uuid4().hex[:8],
                gpu_uuid=f"GPU-{uuid.uuid4()}",
                uuid=f"GPU-{uuid.uuid4()}",
                cores=30,
                memory_bytes=20 * GIB,
                total_memory_bytes=80 * GIB,
                cdi_device_ids=[f"k8s.gpu.gpuslice.dev/claim={uid}-gpu-{i % 8}"],
                shared=True,
            )
        ],
        enforcement="soft",
        enforcer_share_id=f"sh-{uuid.uuid4().hex[:12]}",
        enforcer_edits={
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/opt/gpuslice/bin/gpuslice-enforcer-hook",
                    "args": ["gpuslice-enforcer-hook", "attach", "--share", uid],
                }
            ],
            "env": [f"GPUSLICE_SHARE={uid}"],
        },
        memory_mechanism="memory-partition",
        cores_mechanism="watchdog",
        updated=time.time(),
    )


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(samples: list[float]) -> str:
    return (
        f"p50 {statistics.median(samples) * 1000:7.2f} ms  p99 {pct(samples, 0.99) * 1000:7.2f} ms"
    )


def bench_size(root: Path, size: int, commits: int) -> None:
    state_dir = root / f"n{size}"
    state_dir.mkdir()
    store = open_store(state_dir)
    committer = Committer(store)

    store.save(PluginState(claims={r.uid: r for r in (claim(i) for i in range(size))}))
    commit_times: list[float] = []
    read_times: list[float] = []
    for i in range(commits):
        record = claim(size + i)

        def add(txn: Txn[PluginState], record: ClaimRecord = record) -> None:
            txn.put(record.uid, record)

        t0 = time.perf_counter()
        committer.run(add)
        commit_times.append(time.perf_counter() - t0)
        other = open_store(state_dir)  # another reader: its cache cannot know these files yet
        t0 = time.perf_counter()
        other.read()
        read_times.append(time.perf_counter() - t0)

        def drop(txn: Txn[PluginState], uid: str = record.uid) -> None:
            txn.delete(uid)

        committer.run(drop)
    compactions: list[float] = []
    state = store.read()
    for _ in range(5):
        t0 = time.perf_counter()
        store.save(state)
        compactions.append(time.perf_counter() - t0)
    size_kib = store.path.stat().st_size / 1024
    print(
        f"  {size:>5} prepared claims: commit {ms(commit_times)} | "
        f"compaction p50 {statistics.median(compactions) * 1000:7.2f} ms | "
        f"full read {ms(read_times)} | base {size_kib:8.1f} KiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="Comma-separated claim counts.")
    parser.add_argument("--commits", type=int, default=200, help="Commits measured per size.")
    args = parser.parse_args()
    print("kubelet plugin checkpoint, by the number of prepared claims on the node:")
    with tempfile.TemporaryDirectory(prefix="gpuslice-bench-ckpt-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            bench_size(Path(tmp), size, args.commits)


if __name__ == "__main__":
    main()
