"""Which ``libnvidia-ml.so.1`` the real backend loads: the driver root's, else the loader's.

NVIDIA's DRA driver does not need the NVIDIA Container Toolkit for its own pods: it mounts the
host's driver root and loads ``libnvidia-ml.so.1`` from it (go-nvml's ``WithLibraryPath``). So
do we. Given a driver root (``--driver-root``, env ``GPUSLICE_DRIVER_ROOT``; the chart mounts
the host's at ``/driver-root``), the library is looked for in the driver root's library
directories in NVIDIA's order (``gpuslice_core.driverroot.LIBRARY_DIRS``, the same list that
finds the libraries CDI specs give containers), links resolved within the root, and that file
is loaded. Without a driver root (``/`` counts as none: this process's own ``/`` is its image,
where the toolkit injects the library, or a host install the loader finds through
``ld.so.cache``) or when the root has no library, ``dlopen("libnvidia-ml.so.1")`` searches as it
always did.

How the file reaches pynvml: nvidia-ml-py has no option for a library path; it calls
``CDLL("libnvidia-ml.so.1")`` on its first ``nvmlInit`` and keeps the handle in its
``nvmlLib`` global. We load the found file with ``ctypes.CDLL(path)`` (``RTLD_GLOBAL``)
*before* that first ``nvmlInit``. glibc's ``dlopen`` of a name without a slash first looks
through the objects already loaded, matching their ``DT_SONAME`` (every libnvidia-ml's is
``libnvidia-ml.so.1``), so pynvml's own ``dlopen`` returns the handle of the file we loaded,
whatever the loader's search path holds. This uses only documented ``dlopen`` behaviour and
pynvml's public calls; assigning pynvml's ``nvmlLib`` ourselves would also work but writes a
module global pynvml treats as private state (its lock and refcount live next to it), which a
new nvidia-ml-py may rename or guard. :func:`pynvml_uses_it` checks afterwards that pynvml has
the handle it was meant to have. A process holds one libnvidia-ml for its life: the first
:func:`preload` decides, later calls reuse what it found.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pynvml

from gpuslice_core.driverroot import BINARY_DIRS, find_library, library_candidates, resolve

SONAME = "libnvidia-ml.so.1"
LOADER = "the loader's search path (ld.so.cache, LD_LIBRARY_PATH)"


@dataclass(frozen=True)
class Library:
    """Where this process's libnvidia-ml came from: ``path`` (None: the loader's search path)
    and the driver-root paths looked at before falling back to the loader."""

    path: Path | None = None
    tried: tuple[Path, ...] = field(default=())
    root: Path | None = None

    def describe(self) -> str:
        return str(self.path) if self.path is not None else LOADER

    def not_found_hint(self) -> str:
        """For an nvmlInit that found no library: what was tried."""
        if not self.tried:
            return f"{SONAME} is not on {LOADER}"
        root = self.root or Path("/")
        tried = ", ".join(str(p.parent.relative_to(root)) for p in self.tried)
        return (
            f"{SONAME} is in none of the library directories of the driver root {root} "
            f"({tried}) nor on {LOADER}"
        )


_lock = threading.Lock()
_handle: ctypes.CDLL | None = None
_loaded: Library | None = None


def uses_driver_root(driver_root: Path | None) -> bool:
    return driver_root is not None and driver_root != Path("/")


def preload(driver_root: Path | None) -> Library:
    """Load the driver root's ``libnvidia-ml.so.1`` into the process, where there is one, so
    pynvml's ``nvmlInit`` uses it. Call before ``nvmlInit``; the first call of a process
    decides (the library cannot be swapped once loaded), later calls return what it found.
    ``OSError`` when the found file cannot be loaded (a wrong architecture, not a library)."""
    global _handle, _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if not uses_driver_root(driver_root):
            _loaded = Library()
            return _loaded
        assert driver_root is not None
        found = find_library(driver_root, SONAME)
        if found is None:
            tried = tuple(library_candidates(driver_root, SONAME))
            _loaded = Library(tried=tried, root=driver_root)
            return _loaded
        _handle = ctypes.CDLL(str(found), mode=ctypes.RTLD_GLOBAL)
        _loaded = Library(path=found, root=driver_root)
        return _loaded


def nvidia_smi(driver_root: Path | None, library: Library) -> tuple[str, dict[str, str] | None]:
    """The ``nvidia-smi`` to run and its environment: the driver root's (the first of its
    binary directories that has one), with the directory of the library this process loaded
    first on ``LD_LIBRARY_PATH`` so it finds the same libnvidia-ml; else ``nvidia-smi`` on
    ``PATH`` (toolkit injection, a host install) with this process's environment."""
    if uses_driver_root(driver_root):
        assert driver_root is not None
        for directory in BINARY_DIRS:
            found = resolve(driver_root, driver_root / directory / "nvidia-smi")
            if found is not None and os.access(found, os.X_OK):
                env = dict(os.environ)
                if library.path is not None:
                    paths = [str(library.path.parent), env.get("LD_LIBRARY_PATH", "")]
                    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
                return str(found), env
    return "nvidia-smi", None


def pynvml_uses_it() -> bool:
    """After ``nvmlInit``: whether pynvml's library is the one :func:`preload` loaded (True
    when nothing was preloaded: the loader's library is the only one). Reads pynvml's cached
    handle, only to check."""
    if _handle is None:
        return True
    theirs = getattr(pynvml, "nvmlLib", None)  # read only; see the module's docstring
    return getattr(theirs, "_handle", None) == _handle._handle
