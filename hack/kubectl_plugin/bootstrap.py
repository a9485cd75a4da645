"""The ``__main__`` of the single-file ``kubectl-gpuslice`` (hack/kubectl_plugin/build.py).

The plugin and its dependencies are pure Python and are imported straight from the zip
(``<file>/_vendor`` on ``sys.path``), so the one file runs on any platform with a python3 of
``MIN_PYTHON`` or later (decision 15). This file itself keeps to syntax an older python3 parses,
so that one says what it needs instead of failing on a newer construct.
"""

import sys
from pathlib import Path

MIN_PYTHON = (3, 10)


def main() -> None:
    if sys.version_info < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        have = ".".join(map(str, sys.version_info[:2]))
        sys.stderr.write(
            f"kubectl-gpuslice: needs Python {need} or later; this is {have} ({sys.executable})\n"
        )
        sys.exit(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent / "_vendor"))
    from gpuslice_kubectl.cli import main as cli

    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
