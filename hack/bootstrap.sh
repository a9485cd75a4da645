#!/usr/bin/env bash
# Creates the development environment from a fresh clone: installs a pinned uv into
# .tools/ (never system-wide) and syncs every workspace member into .venv/.
# Needs only python3.11 and the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.8
TOOLS_DIR=.tools
UV="$TOOLS_DIR/uv/bin/uv"
PYTHON=${PYTHON:-python3.11}

if [ ! -x "$UV" ] || [ "$("$UV" --version | awk '{print $2}')" != "$UV_VERSION" ]; then
  echo ">> installing uv $UV_VERSION into $TOOLS_DIR/uv"
  rm -rf "$TOOLS_DIR/uv"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$TOOLS_DIR/uv" "uv==$UV_VERSION"
fi

export UV_PYTHON_DOWNLOADS=never
echo ">> syncing the workspace into .venv (all members, dev tools)"
"$UV" sync --locked --all-packages --python "$PYTHON" --quiet
echo ">> .venv ready: $(.venv/bin/python --version)"
