#!/usr/bin/env bash
# Developer tooling for wsync: install what the build needs, build, run the
# main job, run every test, and make the self-contained bundle for GPU machines.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="${WSYNC_BUILD_DIR:-$root/build}"
jobs=$(nproc 2>/dev/null || echo 2)

# Debian packages wsync builds and tests with (see README.md).
packages=(
  build-essential cmake pkg-config
  luajit libluajit-5.1-dev
  libuv1-dev lua-luv-dev lua-luv
  lua-cjson-dev lua-cjson
  libssl-dev
  lua-busted lua-check
  valgrind util-linux
  clang libclang-rt-dev
  python3 python3-venv
)

usage() {
  cat <<'USAGE'
usage: scripts/dev.sh COMMAND

  setup   install the Debian packages wsync needs (only those missing)
  build   setup, then configure and build into build/ (WSYNC_BUILD_DIR)
  install [PREFIX]
          build, then install wsync (bin/wsync, lib/libwsync.so, include/wsync.h,
          share/wsync: the Lua sources and the recipes) into PREFIX (default
          $WSYNC_PREFIX, else /usr/local as root and ~/.local otherwise)
  demo    install, then run the main job with the installed wsync:
          wsync run recipes/demo.lua
  test    build, then run every test tier through CTest (unit, bindings,
          functional, functional-shuffled (the functional tier once more, its
          spec files in a shuffled order; the seed is printed at the end),
          gpu (pending without a device), embed, memcheck,
          python (pytest over the Python package, in build/venv from PyPI),
          wheel (the wheel built by pip and used from a fresh venv), install
          (cmake --install into a temporary prefix and used from there),
          lint (luacheck), fuzz (a bounded smoke of the fuzz target))
  bundle  build, then gather bin/wsync, busted, the Python package with
          libwsync and its shared objects for a GPU machine into build/bundle
          (and build/bundle.tar.xz, the same as one archive)
  fuzz [SECONDS]
          setup, then build the fuzz target into build-fuzz/ (clang, libFuzzer,
          ASan, UBSan) and fuzz the control protocol and the recipe loader
          for SECONDS (default: until Ctrl-C); see tests/fuzz/run.sh
USAGE
}

setup() {
  local missing=()
  for package in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$package")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1 || ! sudo -n true 2>/dev/null; then
      echo "dev.sh: these Debian packages are missing: ${missing[*]}" >&2
      echo "dev.sh: installing them needs root, and this user ($(id -un)) has no sudo that works without a" \
        "password here. As root, run:" >&2
      echo "  apt-get update && apt-get install -y --no-install-recommends ${missing[*]}" >&2
      echo "then run this command again (or run it with sudo configured)." >&2
      return 1
    fi
    sudo=(sudo -n)
  fi
  echo "dev.sh: installing Debian packages: ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

build() {
  setup
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" -j "$jobs"
}

# The prefix `install` uses: its argument, $WSYNC_PREFIX, else /usr/local as root
# and ~/.local (whose bin/ Debian's ~/.profile puts on PATH) otherwise.
prefix="${WSYNC_PREFIX:-}"
if [ -z "$prefix" ]; then
  if [ "$(id -u)" -eq 0 ]; then prefix=/usr/local; else prefix="$HOME/.local"; fi
fi

install_wsync() {
  build
  case "$prefix" in /*) ;; *) prefix="$PWD/$prefix" ;; esac
  cmake --install "$build" --prefix "$prefix" >/dev/null
}

# One line: where the installed wsync is, and whether the shell finds it by name.
say_where() {
  local found
  found=$(command -v wsync || true)
  if [ "$found" = "$prefix/bin/wsync" ]; then
    echo "dev.sh: wsync is installed in $prefix/bin/wsync (on your PATH)"
  elif [ -n "$found" ]; then
    echo "dev.sh: wsync is installed in $prefix/bin/wsync, but $found comes first on your PATH"
  else
    echo "dev.sh: wsync is installed in $prefix/bin/wsync, not on your PATH: export PATH=\"$prefix/bin:\$PATH\""
  fi
}

demo() {
  install_wsync
  cd "$root"
  local status=0
  "$prefix/bin/wsync" run recipes/demo.lua || status=$?
  say_where
  return "$status"
}

run_tests() {
  build
  cd "$build"
  local status=0
  # CTest prints a tier's line once it ended (functional and memcheck take minutes):
  # a line every 30 s says which one runs and for how long.
  (
    started=$SECONDS
    sleeper=""
    trap 'kill $sleeper 2>/dev/null; exit 0' TERM
    while :; do
      sleep "${WSYNC_PROGRESS_SECONDS:-30}" &
      sleeper=$!
      wait "$sleeper"
      current=$(grep -E '^ +Start +[0-9]+: ' ctest.log 2>/dev/null | tail -n 1 | sed 's/^ *Start *[0-9]*: //')
      if [ -n "$current" ]; then
        echo "dev.sh: still running the $current tier ($((SECONDS - started)) s since the tests began)"
      fi
    done
  ) &
  local heartbeat=$!
  ctest --output-on-failure --timeout 2400 | tee ctest.log || status=${PIPESTATUS[0]}
  kill "$heartbeat" 2>/dev/null
  wait "$heartbeat" 2>/dev/null
  # Show the busted counts of every tier, the GPU tier's pending tests among
  # them (never passed silently), and pytest's, the seed of the shuffled
  # order (`wsync test --shuffle-files --seed=N tests/functional` runs it
  # again), then repeat CTest's summary so that it closes the run.
  if [ -f Testing/Temporary/LastTest.log ]; then
    grep -E '^[0-9]+ successes? / [0-9]+ failures? / [0-9]+ errors? / [0-9]+ pending' \
      Testing/Temporary/LastTest.log | sed 's/^/busted: /' || true
    grep -E '^wsync test: a shuffled order, seed [0-9]+' Testing/Temporary/LastTest.log \
      | sed 's/^wsync test: /functional-shuffled: /' || true
    grep -E '^[0-9]+ (passed|failed|skipped|errors?)(, [0-9]+ [a-z]+)* in [0-9.]+s' \
      Testing/Temporary/LastTest.log | sed 's/^/pytest: /' || true
  fi
  grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' ctest.log | tail -n 1 || true
  return "$status"
}

bundle() {
  build
  local out="$build/bundle"
  rm -rf "$out"
  mkdir -p "$out/bin" "$out/lua/share" "$out/lua/lib"
  cp "$build/wsync" "$out/bin/wsync"
  if [ -f "$build/wsync_copy_shapes" ]; then
    cp "$build/wsync_copy_shapes" "$out/bin/" # (a GPU benchmark: tests/bench/copy_shapes.cu)
  fi
  # busted and its helpers, as Debian installed them, so `wsync test` runs the
  # GPU tier on a machine that has none of them. Never committed: build/ only.
  cp -rL /usr/share/lua/5.1/. "$out/lua/share/"
  cp -rL /usr/lib/x86_64-linux-gnu/lua/5.1/. "$out/lua/lib/"
  rm -f "$out/lua/lib/luv.so" "$out/lua/lib/cjson.so"
  # The Python package with libwsync beside it, and the shared objects
  # libwsync needs that a GPU machine lacks (LuaJIT, libuv, luv, lua-cjson).
  mkdir -p "$out/python" "$out/lib"
  cp -r "$root/bindings/python/wsync" "$out/python/wsync"
  find "$out/python" -name __pycache__ -prune -exec rm -rf {} +
  cp -L "$build/libwsync.so" "$out/python/wsync/libwsync.so"
  ldd "$build/libwsync.so" | awk '/luajit|libuv|luv|cjson/ { print $3 }' | while read -r dependency; do
    cp -L "$dependency" "$out/lib/"
  done
  cat >"$out/env.sh" <<'ENV'
# Source from the repository root on the GPU machine: uses the bundled busted,
# and the bundled Python package (python/wsync, libwsync beside it).
bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LUA_PATH="./?.lua;$bundle/lua/share/?.lua;$bundle/lua/share/?/init.lua"
export LUA_CPATH="$bundle/lua/lib/?.so"
export WSYNC_BIN="$bundle/bin/wsync"
export WSYNC_PROGRAM="$bundle/bin/wsync"
export PATH="$bundle/bin:$PATH"
export PYTHONPATH="$bundle/python${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ENV
  # The same as one archive (about 3 MB): what a GPU run carries beside the
  # 51 MiB vLLM bundle within its 64 MiB (tests/gpu/run.sh unpacks it).
  tar -C "$build" -cJf "$build/bundle.tar.xz" bundle
  echo "dev.sh: bundle in $out ($(du -sh "$out" | cut -f1); $build/bundle.tar.xz $(du -sh "$build/bundle.tar.xz" | cut -f1)); bin/wsync needs only: $(ldd "$out/bin/wsync" | awk '{print $1}' | tr '\n' ' ')"
}

case "${1:-}" in
  setup) setup ;;
  build) build ;;
  install)
    prefix="${2:-$prefix}"
    install_wsync
    say_where
    ;;
  demo) demo ;;
  test) run_tests ;;
  bundle) bundle ;;
  fuzz) setup; exec "$root/tests/fuzz/run.sh" "${@:2}" ;;
  -h | --help | help) usage ;;
  *) usage >&2; exit 2 ;;
esac
