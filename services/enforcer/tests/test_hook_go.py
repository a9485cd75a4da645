"""The static hook (services/enforcer/hook, Go) against the Python hook it replaces on the
hosts: the Go unit tests' expectations (services/enforcer/hook/testdata/vectors.json) are what
Python gives — the protobuf classes' bytes, ``repr``, ``float``, ``bounded``,
``bytes.decode(errors="replace")``, ``str.splitlines`` —, the binary loads no libc (no program
interpreter, no dynamic section), and both hooks refuse every bad command line and OCI state
with the same exit status and words. The protocol tests that run both against the attach socket
are in test_hook.py (``hook_kind``). After a change of the cases below, rewrite the vectors:

    .venv/bin/python services/enforcer/tests/test_hook_go.py
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice_enforcer.attachwire import bounded
from gpuslice_protos.gpuslice.v1 import enforcer_pb2 as pb
from gpuslice_testkit.enforcer import go_hook, hook_missing, run_hook_command

VECTORS = Path(__file__).resolve().parents[1] / "hook" / "testdata" / "vectors.json"
CGROUP_LINES = [
    "12:freezer:/kubepods/besteffort/pod0b7e/cri-containerd-" + "a" * 64,
    "0::/kubepods.slice/kubepods-pod0b7e_1.slice/cri-containerd-" + "b" * 64 + ".scope",
    "",
]
ATTACH_CASES = [
    ("c1", "sh-1", "ctr", 42, CGROUP_LINES),
    ("c1", "", "ctr", 4_194_304, []),  # no share id; a pid past two varint bytes
    ("ü-claim", "sh", "ctr-é", 1, ["x" * 300]),  # non-ASCII; a length past one byte
    ("c", "", "ctr", 4_294_967_295, ["", "0::/"]),  # the largest uint32; empty lines kept
    ("", "", "", 0, []),
]
DETACH_CASES = [("c1", "ctr"), ("", "ctr"), ("ü", "")]
JSON_VALUES = [
    "true", "false", "null", "-1", "-0", "123456789012345678901234567890", "1.5", "7.0", "1e3",
    "1e15", "1e16", "1.5e-7", "0.0001", "0.00001", "-0.0", "1e400", "-2.5e-300", '"7"',
    '"it\'s"', '"a\\"b\'c"', '"tab\\there\\n"', '"\\u00e9\\u0001\\u007f\\u0085"', '"\\u2028"',
    '"\\ud83d\\ude00"', '"\\u00a0"', '"back\\\\slash"', "[]", '[1, "x", null, [true]]', "{}",
    '{"a": 1, "b": [false], "c": {"d": 2.50}}',
]  # fmt: skip
FLOATS = [
    "2", " 2.5 ", "1e1", "1E1", ".5", "5.", "+3", "-0", "1_000", "1_0.5_0", "1__0", "_1", "1_",
    "1_e5", "0x10", "0X1p3", "inf", "-Infinity", "nan", "NaN", "soon", "", " ", "1e400",
    "1e-400", "1.5.0", "\t7\n",
]  # fmt: skip
BOUNDED = [("abc", 3), ("abcd", 3), ("ééééé", 2), ("x" * 3000, 2048), ("", 0)]
DECODE = ["61", "e28261", "ff61", "c3a9", "eda080", "f0908d", "c0af", "f4908080", "efbfbd"]
LINES = ["a\nb\n", "", "\n", "a\r\nb\rc", "a\n\nb", "x"]


def _float_repr(text: str) -> str | None:
    try:
        return repr(float(text))
    except ValueError:
        return None


def vectors() -> dict[str, list[dict[str, object]]]:
    return {
        "attach": [
            {
                "claim_uid": claim,
                "share_id": share,
                "container_id": container,
                "pid": pid,
                "cgroup_lines": lines,
                "hex": pb.AttachContainerRequest(
                    claim_uid=claim,
                    share_id=share,
                    container_id=container,
                    pid=pid,
                    cgroup_lines=lines,
                )
                .SerializeToString(deterministic=True)
                .hex(),
            }
            for claim, share, container, pid, lines in ATTACH_CASES
        ],
        "detach": [
            {
                "claim_uid": claim,
                "container_id": container,
                "hex": pb.DetachContainerRequest(claim_uid=claim, container_id=container)
                .SerializeToString(deterministic=True)
                .hex(),
            }
            for claim, container in DETACH_CASES
        ],
        "repr": [{"json": text, "repr": repr(json.loads(text))} for text in JSON_VALUES],
        "float": [{"text": text, "repr": _float_repr(text)} for text in FLOATS],
        "bounded": [
            {"text": text, "limit": limit, "out": bounded(text, limit)} for text, limit in BOUNDED
        ],
        "decode": [
            {"hex": data, "text": bytes.fromhex(data).decode(errors="replace")} for data in DECODE
        ],
        "lines": [{"text": text, "lines": text.splitlines()} for text in LINES],
    }


def render() -> str:
    return json.dumps(vectors(), indent=1, ensure_ascii=True) + "\n"


PT_DYNAMIC, PT_INTERP = 2, 3
SOCKET = "/nonexistent/gpuslice/enforcer.sock"
ATTACH = ["attach", "--socket", SOCKET, "--claim-uid", "u"]
DETACH = ["detach", "--socket", SOCKET, "--claim-uid", "u", "--timeout", "0.5"]
GOOD = '{"id": "c", "pid": 1}'


@pytest.fixture(scope="module")
def binary() -> Path:
    reason = hook_missing("go")
    if reason:
        pytest.skip(reason)
    return go_hook()


def test_the_go_tests_expect_what_python_gives() -> None:
    assert VECTORS.read_text() == render(), (
        "services/enforcer/hook/testdata/vectors.json is not what Python gives; rewrite it: "
        ".venv/bin/python services/enforcer/tests/test_hook_go.py"
    )


def _segments(path: Path) -> list[int]:
    """The program header types of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:6] == b"\x7fELF\x02\x01", "not a 64-bit little-endian ELF file"
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]


def test_the_static_hook_loads_no_libc(binary: Path) -> None:
    segments = _segments(binary)
    assert PT_INTERP not in segments, "it names a program interpreter (ld.so): dynamic"
    assert PT_DYNAMIC not in segments, "it has a dynamic section: it would load libraries"
    assert binary.stat().st_size < 4_000_000
    settings = subprocess.run(
        ["go", "version", "-m", str(binary)], capture_output=True, text=True, check=True
    ).stdout
    assert "CGO_ENABLED=0" in settings and "-trimpath=true" in settings


@pytest.mark.parametrize(
    ("argv", "state"),
    [
        ([], GOOD),
        (["-h"], GOOD),
        (["attach", "--help", "--bogus"], GOOD),
        (["attach", "--claim-uid", "u"], GOOD),
        (["attach", "--socket", "/s"], GOOD),
        (["--socket", "/s", "--claim-uid", "u"], GOOD),
        (["start", "--socket", "/s"], GOOD),
        (["attach", "detach"], GOOD),
        (["-x"], GOOD),
        (["attach", "it's"], GOOD),
        (["attach", 'say "it\'s"\n'], GOOD),
        (["attach", "é\t\x01"], GOOD),
        (["attach", "--"], GOOD),
        ([*ATTACH, "--pid", "3"], GOOD),
        (["attach", "--socket=/s", "--claim-uid=u", "--timeout=soon"], GOOD),
        (["attach", "--socket=/s", "--claim-uid=u", "--timeout=0x10"], GOOD),
        (["attach", "--socket=/s", "--claim-uid=u", "--timeout", "0"], GOOD),
        (["attach", "--socket=/s", "--claim-uid=u", "--timeout", "-1e3"], GOOD),
        (["attach", "--socket=/s", "--claim-uid=u", "--timeout", "nan"], GOOD),
        (["attach", "--socket=", "--claim-uid=u"], GOOD),
        (["attach", "--socket"], GOOD),
        (ATTACH, '{"id": "c", "pid": 0}'),
        (ATTACH, '{"id": "c"}'),
        (ATTACH, '{"pid": 3}'),
        (ATTACH, '{"id": "", "pid": 3}'),
        (ATTACH, '{"id": 7, "pid": 3}'),
        (ATTACH, "[]"),
        (ATTACH, "null"),
        (ATTACH, '"state"'),
        (ATTACH, '{"id": "c", "pid": true}'),
        (ATTACH, '{"id": "c", "pid": -1}'),
        (ATTACH, '{"id": "c", "pid": 1.5}'),
        (ATTACH, '{"id": "c", "pid": 1e2}'),
        (ATTACH, '{"id": "c", "pid": "7"}'),
        (ATTACH, '{"id": "c", "pid": null}'),
        (ATTACH, '{"id": "c", "pid": [1, {"a": "b"}]}'),
        (ATTACH, '{"id": "a", "id": "c", "pid": -2}'),
        (ATTACH, '{"id": "c", "pid": 999999999}'),  # no such process
        (DETACH, '{"id": "c"}'),  # no enforcer: UNAVAILABLE at the timeout
        (DETACH, '\n {"id": "c", "pid": 0, "status": "stopped"}\n'),
    ],
)
def test_both_hooks_answer_alike(binary: Path, argv: list[str], state: str) -> None:
    python = run_hook_command("python", argv, state)
    go = run_hook_command("go", argv, state)
    assert (go.returncode, go.stdout, go.stderr) == (
        python.returncode,
        python.stdout,
        python.stderr,
    )


@pytest.mark.parametrize("state", ["", "{", '{"id": "c", "pid": 7} trailing', "{'id': 'c'}"])
def test_both_hooks_refuse_what_is_not_json(binary: Path, state: str) -> None:
    """The reason after the colon is each JSON parser's own."""
    said = "gpuslice-enforcer-hook: the OCI state is not JSON: "
    for kind in ("python", "go"):
        ran = run_hook_command(kind, ATTACH, state)
        assert ran.returncode == 2 and ran.stderr.startswith(said), (kind, ran.stderr)


if __name__ == "__main__":
    VECTORS.write_text(render())
    print(f"wrote {VECTORS}", file=sys.stderr)
