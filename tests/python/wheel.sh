#!/usr/bin/env bash
# The wheel tier (CTest's `wheel`): builds the distribution wsync-rl from the repository's
# pyproject.toml as `pip install` does (scikit-build-core from PyPI, the C build by CMake
# in WORK/cmake, kept between runs), installs the wheel with its numpy extra into a fresh
# virtual environment, and then, with no WSYNC_* variable and no PYTHONPATH, from the
# repository root: checks that `import wsync` loads the wheel's libwsync, runs README.md's
# Python example verbatim (the fenced block that starts with "# embedding example"), and
# runs the installed command: wsync --help, wsync --version, wsync run recipes/demo.lua.
#
# usage: tests/python/wheel.sh WORK
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=${1:?usage: tests/python/wheel.sh WORK}
mkdir -p "$work"
work=$(cd "$work" && pwd)
# Nothing of a build tree: the wheel alone must serve.
for name in $(compgen -e); do
  case $name in WSYNC_* | PYTHONPATH | VIRTUAL_ENV) unset "$name" ;; esac
done
pip_quiet=(--quiet --disable-pip-version-check)
fail() {
  echo "wheel: $*" >&2
  exit 1
}
seconds() { echo $((SECONDS - $1)); }

# The environment that builds (pip and its build isolation), made once.
if [ ! -x "$work/build-venv/bin/pip" ]; then
  python3 -m venv "$work/build-venv" || fail "python3 -m venv failed (install Debian's python3-venv: scripts/dev.sh setup)"
fi
start=$SECONDS
rm -rf "$work/dist"
SKBUILD_BUILD_DIR="$work/cmake" "$work/build-venv/bin/pip" wheel "${pip_quiet[@]}" --no-deps \
  --wheel-dir "$work/dist" "$root"
wheels=("$work"/dist/wsync_rl-*.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || fail "pip wheel made no wsync_rl wheel in $work/dist"
wheel=${wheels[0]}
contents=$("$work/build-venv/bin/python" -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel")
for file in wsync/__init__.py wsync/libwsync.so wsync/wsync; do
  grep -qx "$file" <<<"$contents" || fail "$(basename "$wheel") has no $file"
done
echo "wheel: built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) in $(seconds "$start") s"

start=$SECONDS
rm -rf "$work/venv"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install "${pip_quiet[@]}" "$wheel[numpy]"
echo "wheel: installed with [numpy] into a fresh venv in $(seconds "$start") s"

cd "$root"
python=$work/venv/bin/python
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
loaded=$("$python" -c 'import wsync; print(wsync.library_path())')
[ "$loaded" = "beside the package ($site/wsync/libwsync.so)" ] || fail "import wsync loaded $loaded"

# README.md's example as it is written, with the venv's python not on PATH (the host finds
# the program beside libwsync).
"$python" - "$work/readme_example.py" <<'EXTRACT'
import sys
text = open("README.md").read()
start = text.index("```python\n# embedding example") + len("```python\n")
open(sys.argv[1], "w").write(text[start:text.index("```", start)])
EXTRACT
mkdir -p "$work/tmp"
start=$SECONDS
output=$(TMPDIR="$work/tmp" "$python" "$work/readme_example.py" </dev/null 2>&1) || fail "README.md's example failed:
$output"
grep -q "verdict: OK: 3 model versions published" <<<"$output" || fail "README.md's example printed no verdict OK:
$output"
echo "wheel: README.md's example ran in $(seconds "$start") s"

# The command, as a shell finds it once the venv is active.
export PATH="$work/venv/bin:$PATH"
[ "$(command -v wsync)" = "$work/venv/bin/wsync" ] || fail "wsync on PATH is $(command -v wsync)"
version=$(sed -n 's/^project(wsync VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
output=$(wsync --version </dev/null) || fail "wsync --version failed: $output"
grep -q "^wsync $version" <<<"$output" || fail "wsync --version says $output, not wsync $version"
output=$(wsync --help </dev/null) || fail "wsync --help failed: $output"
grep -q "^usage: wsync" <<<"$output" || fail "wsync --help printed no usage: $output"
output=$(TMPDIR="$work/tmp" wsync run recipes/demo.lua </dev/null 2>&1) || fail "wsync run recipes/demo.lua failed:
$output"
grep -q "verdict: OK: 3 model versions published" <<<"$output" || fail "wsync run recipes/demo.lua printed no verdict OK:
$output"
echo "wheel: wsync --help, --version and run recipes/demo.lua ran from $work/venv/bin/wsync"
