"""Durable file writes shared by the checkpoint store and the CDI spec writer.

``atomic_write_bytes`` is the one way gpuslice replaces a file that a crash must not tear: temp
file in the same directory, write, flush, fsync, ``os.replace``, fsync the directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_files_for(path: Path) -> list[Path]:
    """Temp files that :func:`atomic_write_bytes` left next to ``path`` (after a crash)."""
    return sorted(path.parent.glob(f".{path.name}.*{TEMP_SUFFIX}"))


def make_dirs(path: Path, mode: int) -> None:
    """Create ``path`` and its missing parents with exactly ``mode``, whatever the umask;
    directories that exist already are left as they are (their owner chose their mode)."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=mode)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs
        directory.chmod(mode)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or new content, never a mix.

    Temp file in the same directory -> write -> flush -> fsync -> ``os.replace`` -> fsync the
    directory. On any failure the temp file is removed and ``path`` is unchanged.

    ``durable=False`` leaves out both fsyncs: the replace is still atomic for every reader and
    survives the writer's kill -9 (the page cache holds it), but not a kernel crash or power
    loss. Only for files whose content dies with the boot anyway (CDI specs of prepared claims).
    """
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
