"""The ``__main__`` of the single-file ``kubectl-gpuslice`` (hack/kubectl_plugin/build.py).

The file vendors compiled extension modules (grpcio, pydantic-core), which Python cannot import
from inside a zip. On the first run the vendored tree is unpacked into
``${XDG_CACHE_HOME:-~/.cache}/kubectl-gpuslice/<build id>/`` (to a temporary folder, then
renamed, so two first runs at once do not see half a tree), then run from there. The build
fills in the three constants below.
"""

import contextlib
import os
import platform
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

BUILD_ID = "unset"
PLATFORM = "unset"
PYTHON = "unset"


def _check() -> None:
    here = f"{sys.platform}-{platform.machine()}"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if python != PYTHON or here != PLATFORM:
        sys.stderr.write(
            f"kubectl-gpuslice: this file is built for CPython {PYTHON} on {PLATFORM}; this is "
            f"Python {python} on {here} ({sys.executable}). Install the build for this "
            f"platform, or run it with python{PYTHON}.\n"
        )
        sys.exit(1)


def _unpacked() -> str:
    archive = Path(__file__).resolve().parent
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "kubectl-gpuslice"
    where = root / BUILD_ID
    if where.is_dir():
        return str(where)
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{BUILD_ID}-", dir=root))
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if member.startswith("_vendor/"):
                    zf.extract(member, scratch)
        with contextlib.suppress(OSError):  # another first run got there first: same tree
            (scratch / "_vendor").rename(where)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(where)


def main() -> None:
    _check()
    sys.path.insert(0, _unpacked())
    from gpuslice_kubectl.cli import main as cli

    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
