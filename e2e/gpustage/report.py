"""The stage's findings: one row per figure, printed as a table and written as JSON.

A row has a verdict: ``pass``/``fail`` against its target, ``measured`` where the issue sets no
target (it never fails the stage), or ``skipped`` with the reason it could not run (it never
passes). The stage exits 1 when any row failed.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

Verdict = Literal["pass", "fail", "measured", "skipped"]
SCHEMA = "gpuslice.gpustage/v1"
GIB = 1 << 30


@dataclass
class Row:
    section: str
    mechanism: str
    figure: str
    value: str
    target: str
    verdict: Verdict
    #: why it failed or was skipped, or what the value does not say on its own
    detail: str = ""
    #: every number behind the value, for the JSON
    data: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "section": self.section,
            "mechanism": self.mechanism,
            "figure": self.figure,
            "value": self.value,
            "target": self.target,
            "verdict": self.verdict,
            "detail": self.detail,
            "data": self.data,
        }


def _host() -> dict[str, object]:
    uname = os.uname()
    return {"hostname": uname.nodename, "kernel": uname.release, "machine": uname.machine}


def judged(ok: bool) -> Verdict:
    return "pass" if ok else "fail"


@dataclass
class Report:
    flags: dict[str, object]
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    host: dict[str, object] = field(default_factory=_host)
    gpu: dict[str, object] = field(default_factory=dict)
    capabilities: dict[str, object] = field(default_factory=dict)
    #: per section: wall seconds it took
    durations: dict[str, float] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def skip(self, section: str, mechanism: str, figure: str, reason: str) -> Row:
        return self.add(Row(section, mechanism, figure, "-", "-", "skipped", reason))

    def count(self, verdict: Verdict) -> int:
        return sum(1 for row in self.rows if row.verdict == verdict)

    @property
    def exit_code(self) -> int:
        return 1 if self.count("fail") else 0

    def to_json(self) -> dict[str, object]:
        finished = self.finished_at or time.time()
        return {
            "schema": SCHEMA,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(finished),
            "duration_s": round(finished - self.started_at, 3),
            "flags": self.flags,
            "host": self.host,
            "gpu": self.gpu,
            "capabilities": self.capabilities,
            "section_durations_s": {k: round(v, 3) for k, v in self.durations.items()},
            "rows": [row.to_json() for row in self.rows],
            "summary": {
                "pass": self.count("pass"),
                "fail": self.count("fail"),
                "measured": self.count("measured"),
                "skipped": self.count("skipped"),
                "exit_code": self.exit_code,
            },
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)

    def table(self) -> str:
        """The rows as a plain-text table; reasons and details go below it, numbered."""
        header = ("section", "mechanism", "figure", "value", "target", "result")
        notes: list[str] = []
        lines: list[tuple[str, ...]] = []
        for row in self.rows:
            result: str = row.verdict
            if row.detail:
                if row.detail not in notes:
                    notes.append(row.detail)
                result = f"{result} [{notes.index(row.detail) + 1}]"
            lines.append((row.section, row.mechanism, row.figure, row.value, row.target, result))
        widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
        out = [_cells(header, widths), _cells(tuple("-" * w for w in widths), widths)]
        out += [_cells(cells, widths) for cells in lines]
        out.append("")
        out += [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
        summary = self.to_json()["summary"]
        assert isinstance(summary, dict)
        out.append(
            f"{summary['pass']} passed, {summary['fail']} failed, {summary['measured']} measured, "
            f"{summary['skipped']} skipped"
        )
        return "\n".join(out)


def _cells(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d}Z"


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


class Section:
    """Times a section; an exception in it becomes a failed row with the error and the stage
    goes on with the next section (``__exit__`` returns True for an ``Exception``)."""

    def __init__(self, report: Report, name: str, mechanism: str) -> None:
        self.report, self.name, self.mechanism = report, name, mechanism
        self.key = name if mechanism == "-" else f"{name}/{mechanism}"

    def __enter__(self) -> None:
        self.start = time.monotonic()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        took = time.monotonic() - self.start
        self.report.durations[self.key] = self.report.durations.get(self.key, 0.0) + took
        if not isinstance(exc, Exception):
            return False
        detail = f"{type(exc).__name__}: {exc}"
        data: dict[str, object] = {"traceback": "".join(traceback.format_exception(exc))[-4000:]}
        self.report.add(
            Row(self.name, self.mechanism, "section", "crashed", "-", "fail", detail, data)
        )
        return True
