"""hack/chart_readme.py: the chart README's values table is values.yaml's, and every value has
a description."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "chart_readme.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_readme", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


chart_readme = load()


def test_the_readme_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_value_is_described() -> None:
    """Each leaf of values.yaml is a row, or inside a documented map or list."""
    text = (ROOT / "charts" / "gpuslice" / "values.yaml").read_text()
    keys = {row.key for row in chart_readme.rows(text)}

    def leaves(node: object, path: tuple[str, ...] = ()) -> list[str]:
        if isinstance(node, dict) and node:
            return [leaf for k, v in node.items() for leaf in leaves(v, (*path, str(k)))]
        return [".".join(path)]

    undocumented = [
        leaf
        for leaf in leaves(yaml.safe_load(text))
        if not any(leaf == key or leaf.startswith(key + ".") for key in keys)
    ]
    assert undocumented == []


def test_rows_follow_helm_docs_comments() -> None:
    values = """\
# A group: no row of its own.
group:
  # -- A string,
  # continued.
  name: ""
  # -- (int) A port that may be empty.
  port: null
  # -- A list; keys inside its items are not values.
  items:
    - key: a
      value: b
  # -- A map.
  map: {a: 1}
  script: |
    # -- not a comment of a key
    inside: the string
# -- A flag with a | pipe.
flag: true
undocumented: 3
"""
    rows = chart_readme.rows(values)
    assert [(r.key, r.type, r.default, r.description) for r in rows] == [
        ("group.name", "string", '""', "A string, continued."),
        ("group.port", "int", "null", "A port that may be empty."),
        (
            "group.items",
            "list",
            '[{"key":"a","value":"b"}]',
            "A list; keys inside its items are not values.",
        ),
        ("group.map", "object", '{"a":1}', "A map."),
        ("flag", "bool", "true", "A flag with a | pipe."),
    ]
    table = chart_readme.table(values)
    assert r"A flag with a \| pipe." in table
    assert chart_readme.cell("<release> and `<code>`") == "&lt;release&gt; and `<code>`"


def test_check_fails_on_a_stale_readme(tmp_path: Path) -> None:
    (tmp_path / "values.yaml").write_text("# -- Described.\nkey: 1\n")
    (tmp_path / "README.md").write_text(f"# x\n{chart_readme.BEGIN}\nold\n{chart_readme.END}\n")
    assert chart_readme.main(["--check", "--chart", str(tmp_path)]) == 1
    assert chart_readme.main(["--chart", str(tmp_path)]) == 0
    assert "| `key` | int | `1` | Described. |" in (tmp_path / "README.md").read_text()
    assert chart_readme.main(["--check", "--chart", str(tmp_path)]) == 0
