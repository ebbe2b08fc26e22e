#!/usr/bin/env bash
# The Python tier (CTest's `python`): makes the virtual environment VENV (once; the
# packages of tests/python/requirements.txt from PyPI), installs the package with pip
# from the repository's pyproject.toml as users do, but without its CMake build (the
# Python files alone: tests/python/wheel.sh checks the whole wheel), then runs pytest
# over tests/python against $WSYNC_LIBRARY and $WSYNC_BIN of the build tree. A machine
# without python3 and its venv module fails here, saying so.
#
# usage: tests/python/run.sh VENV [PYTEST ARGS...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${1:?usage: tests/python/run.sh VENV [PYTEST ARGS...]}
shift
requirements="$root/tests/python/requirements.txt"
if ! command -v python3 >/dev/null; then
  echo "python tier: python3 not found (install Debian's python3 and python3-venv: scripts/dev.sh setup)" >&2
  exit 1
fi
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$requirements" "$stamp"; then
  rm -rf "$venv"
  if ! python3 -m venv "$venv"; then
    echo "python tier: python3 -m venv failed (install Debian's python3-venv: scripts/dev.sh setup)" >&2
    exit 1
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$stamp"
fi
# The package as it is in the tree now, installed (not imported from the tree).
SKBUILD_WHEEL_CMAKE=false "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  --no-build-isolation --no-deps --force-reinstall "$root"
cd "$root"
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs "$@" tests/python
