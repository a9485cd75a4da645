"""hack/gen_protos.py: the checked-in code is fresh, and --check notices every kind of drift."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "hack" / "gen_protos.py"


def _load_generator() -> ModuleType:
    """Import hack/gen_protos.py (a script, not a package) as the module ``gen_protos``."""
    if "gen_protos" in sys.modules:
        return sys.modules["gen_protos"]
    spec = importlib.util.spec_from_file_location("gen_protos", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_checked_in_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


@pytest.mark.timeout(60)
def test_check_reports_drift_and_regeneration_repairs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = _load_generator()
    proto_root = tmp_path / "proto"
    (proto_root / "demo" / "v1").mkdir(parents=True)
    (proto_root / "demo" / "v1" / "demo.proto").write_text(
        'syntax = "proto3";\npackage demo.v1;\n'
        "message Ping { string text = 1; }\n"
        "service Echo { rpc Say(Ping) returns (Ping) {} }\n",
        encoding="utf-8",
    )
    tree = tmp_path / "pkg"
    tree.mkdir()
    (tree / "__init__.py").write_text('"""Hand-written."""\n', encoding="utf-8")

    assert gen.run(check=True, proto_root=proto_root, tree_dir=tree) == 1
    assert "missing (not generated yet): demo/v1/demo_pb2_grpc.py" in capsys.readouterr().err

    assert gen.run(check=False, proto_root=proto_root, tree_dir=tree) == 0
    assert (tree / "demo" / "v1" / "demo_pb2.pyi").is_file()
    assert (tree / "__init__.py").read_text(encoding="utf-8") == '"""Hand-written."""\n'
    first = {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()}
    assert gen.run(check=True, proto_root=proto_root, tree_dir=tree) == 0

    (tree / "demo" / "v1" / "demo_pb2.py").write_text("# edited by hand\n", encoding="utf-8")
    (tree / "demo" / "v1" / "old_pb2.py").write_text("# from a deleted proto\n", encoding="utf-8")
    capsys.readouterr()
    assert gen.run(check=True, proto_root=proto_root, tree_dir=tree) == 1
    err = capsys.readouterr().err
    assert "stale (content differs): demo/v1/demo_pb2.py" in err
    assert "extra (no proto produces it): demo/v1/old_pb2.py" in err

    assert gen.run(check=False, proto_root=proto_root, tree_dir=tree) == 0
    assert {p: p.read_bytes() for p in tree.rglob("*") if p.is_file()} == first

    shutil.rmtree(proto_root / "demo")
    (proto_root / "other.proto").write_text(
        'syntax = "proto3";\npackage other;\n', encoding="utf-8"
    )
    assert gen.run(check=False, proto_root=proto_root, tree_dir=tree) == 0
    assert not (tree / "demo").exists()
    assert (tree / "other_pb2.py").is_file()


def test_rejects_proto_paths_that_are_not_module_names(tmp_path: Path) -> None:
    gen = _load_generator()
    (tmp_path / "dra-health").mkdir()
    (tmp_path / "dra-health" / "api.proto").write_text('syntax = "proto3";\n', encoding="utf-8")
    with pytest.raises(gen.GenerationError, match="'dra-health' is not a valid Python module"):
        gen.find_protos(tmp_path)
