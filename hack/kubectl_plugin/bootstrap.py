"""The ``__main__`` of the single-file ``kubectl-gpuslice`` (hack/kubectl_plugin/build.py).

The plugin and its pure-Python dependencies are imported straight from the zip
(``<file>/_vendor`` on ``sys.path``). Python cannot import a compiled extension module from a
zip, so the packages that hold one (``UNPACK``: pydantic-core, the compiled core of the pydantic
that kubernetes 37's client is built on) are unpacked on the first run into
``${XDG_CACHE_HOME:-~/.cache}/kubectl-gpuslice/<build id>/`` (to a temporary folder, then
renamed, so two first runs at once do not see half a tree) and imported from there. Because of
them the file is for one platform and CPython minor version; where ``UNPACK`` is empty it is for
any. The build fills in the four constants below.
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
UNPACK: tuple[str, ...] = ()


def _check() -> None:
    here = f"{sys.platform}-{platform.machine()}"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if PLATFORM != "any" and (python != PYTHON or here != PLATFORM):
        sys.stderr.write(
            f"kubectl-gpuslice: this file is built for CPython {PYTHON} on {PLATFORM}; this is "
            f"Python {python} on {here} ({sys.executable}). Install the build for this "
            f"platform, or run it with python{PYTHON}.\n"
        )
        sys.exit(1)


def _unpacked(archive: Path) -> str:
    """The folder that holds the ``UNPACK`` packages, unpacked from ``archive`` if need be."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = cache / "kubectl-gpuslice"
    where = root / BUILD_ID
    if where.is_dir():
        return str(where)
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{BUILD_ID}-", dir=root))
    prefixes = tuple(f"_vendor/{name}/" for name in UNPACK)
    try:
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if member.startswith(prefixes):
                    zf.extract(member, scratch)
        with contextlib.suppress(OSError):  # another first run got there first: same tree
            (scratch / "_vendor").rename(where)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(where)


def main() -> None:
    _check()
    archive = Path(__file__).resolve().parent
    sys.path.insert(0, str(archive / "_vendor"))
    if UNPACK:
        sys.path.insert(0, _unpacked(archive))
    from gpuslice_kubectl.cli import main as cli

    sys.exit(cli(sys.argv[1:]))


if __name__ == "__main__":
    main()
