#!/usr/bin/env bash
# The install check (CTest's `install`): `cmake --install BUILD` into the fresh prefix
# WORK/prefix, then, from a directory outside the repository and with no WSYNC_*
# variable: the installed wsync --version; wsync run of the installed demo recipe; wsync
# check of it with the installed Lua sources (WSYNC_SCRIPTS=PREFIX/share/wsync/lua); and
# tests/embed/embed_example.c compiled by CC against the installed wsync.h and libwsync,
# running the installed smoke recipe.
#
# usage: tests/install.sh BUILD WORK CC
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage="usage: tests/install.sh BUILD WORK CC"
build=${1:?$usage}
work=${2:?$usage}
cc=${3:?$usage}
for name in $(compgen -e); do
  case $name in WSYNC_*) unset "$name" ;; esac
done
fail() {
  echo "install: $*" >&2
  exit 1
}

rm -rf "$work"
mkdir -p "$work/run" "$work/tmp"
work=$(cd "$work" && pwd)
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >"$work/install.log" || fail "cmake --install failed: $(cat "$work/install.log")"
for file in bin/wsync include/wsync.h lib/libwsync.so lib/libwsync.so.0 share/wsync/lua/wsync/init.lua \
  share/wsync/recipes/demo.lua; do
  [ -e "$prefix/$file" ] || fail "cmake --install put no $file in the prefix"
done
echo "install: cmake --install put $(wc -l <"$build/install_manifest.txt") files in $prefix"

cd "$work/run"
export TMPDIR=$work/tmp
version=$(sed -n 's/^project(wsync VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
output=$("$prefix/bin/wsync" --version </dev/null) || fail "wsync --version failed: $output"
grep -q "^wsync $version" <<<"$output" || fail "wsync --version says $output, not wsync $version"
output=$("$prefix/bin/wsync" run "$prefix/share/wsync/recipes/demo.lua" </dev/null 2>&1) ||
  fail "wsync run PREFIX/share/wsync/recipes/demo.lua failed:
$output"
grep -q "verdict: OK: 3 model versions published" <<<"$output" || fail "the installed demo printed no verdict OK:
$output"
output=$(WSYNC_SCRIPTS="$prefix/share/wsync/lua" "$prefix/bin/wsync" check "$prefix/share/wsync/recipes/demo.lua" \
  </dev/null 2>&1) || fail "wsync check with WSYNC_SCRIPTS=PREFIX/share/wsync/lua failed:
$output"
echo "install: the installed wsync $version ran the installed demo, and checked it with the installed Lua sources"

"$cc" -o "$work/embed_example" "$root/tests/embed/embed_example.c" -I"$prefix/include" -L"$prefix/lib" -lwsync \
  -Wl,-rpath,"$prefix/lib" || fail "embed_example.c does not build against the installed wsync.h and libwsync"
output=$("$work/embed_example" "$prefix/share/wsync/recipes/smoke.lua" </dev/null 2>&1) ||
  fail "embed_example against the installed libwsync failed:
$output"
grep -q "^embed_example: ok (wsync $version)" <<<"$output" || fail "embed_example printed: $output"
echo "install: a C program built against the installed wsync.h and libwsync ran the installed smoke recipe"
rm -rf "$prefix" "$work/run" "$work/tmp"
