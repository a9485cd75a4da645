"""Fills plugins/gpuslice.yaml, the krew manifest, for one release: the version, the repository
the archive is released from, and the archive's sha256 (read from the
``kubectl-gpuslice.tar.gz.sha256`` file hack/kubectl-plugin.sh writes). The archive is one for
every platform (the plugin is pure Python: decision 15). Every placeholder must be filled; one
left over, or the sha256 file missing, is an error.

usage: python krew_manifest.py --version X.Y.Z --repository OWNER/NAME --sha-dir DIR --out FILE
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[2] / "plugins" / "gpuslice.yaml"
ARCHIVE = "kubectl-gpuslice.tar.gz"


def fill(template: str, version: str, repository: str, sha_dir: Path) -> str:
    values = {"VERSION": version.removeprefix("v"), "REPOSITORY": repository}
    file = sha_dir / f"{ARCHIVE}.sha256"
    if not file.is_file():
        raise SystemExit(f"krew_manifest.py: no {file}")
    digest = (file.read_text().split() or [""])[0]
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise SystemExit(f"krew_manifest.py: {file} holds no sha256")
    values["SHA256"] = digest
    filled = re.sub(r"__([A-Z0-9_]+?)__", lambda m: values.get(m.group(1), m.group(0)), template)
    left = sorted(set(re.findall(r"__[A-Z0-9_]+?__", filled)))
    if left:
        raise SystemExit(f"krew_manifest.py: placeholders left unfilled: {', '.join(left)}")
    return filled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True, help="The release's version, X.Y.Z[-PRE].")
    parser.add_argument("--repository", required=True, help="The GitHub OWNER/NAME.")
    parser.add_argument("--sha-dir", type=Path, required=True, help="The .sha256 file's folder.")
    parser.add_argument("--out", type=Path, required=True, help="The manifest to write.")
    args = parser.parse_args()
    args.out.write_text(fill(TEMPLATE.read_text(), args.version, args.repository, args.sha_dir))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
