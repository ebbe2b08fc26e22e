#!/usr/bin/env bash
# Builds the fuzz target (tests/fuzz/fuzz_wsync.c: libFuzzer, ASan and UBSan,
# clang, the CMake option WSYNC_FUZZ) in its own build directory and runs it
# over the committed seed corpus and regressions.
#
# usage: tests/fuzz/run.sh [SECONDS]   fuzz for SECONDS (default: until Ctrl-C)
#        tests/fuzz/run.sh --smoke     CTest's `fuzz` test: replays every
#                                      committed input, then fuzzes for
#                                      $WSYNC_FUZZ_SMOKE_SECONDS (default 30)
#                                      from a scratch corpus
#
# The build directory is $WSYNC_FUZZ_BUILD_DIR (default build-fuzz/). A long
# run keeps the inputs it finds interesting in build-fuzz/corpus/; findings
# (crash-*, timeout-*, oom-*, leak-*) go to build-fuzz/findings/. Replay one
# with `build-fuzz/wsync_fuzz FILE`, or without sanitizers with
# `build/wsync tests/fuzz/replay.lua FILE`; once fixed, keep it in
# tests/fuzz/regressions/ and say what it found in tests/fuzz/README.md (the
# unit tier replays that folder).
# $WSYNC_FUZZ_JOBS > 1 runs that many fuzzing processes (libFuzzer's -fork).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build="${WSYNC_FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs=$(nproc 2>/dev/null || echo 2)

smoke=no
seconds=""
case "${1:-}" in
  --smoke) smoke=yes; seconds="${WSYNC_FUZZ_SMOKE_SECONDS:-30}" ;;
  "") ;;
  *[!0-9]* | 0) echo "usage: tests/fuzz/run.sh [SECONDS] | --smoke" >&2; exit 2 ;;
  *) seconds="$1" ;;
esac

# Without clang's libFuzzer the smoke is skipped (CTest shows it as skipped;
# `scripts/dev.sh setup` installs both).
if ! command -v clang >/dev/null 2>&1 ||
   [ ! -f "$(clang -print-resource-dir)/lib/linux/libclang_rt.fuzzer-$(uname -m).a" ]; then
  echo "fuzz: needs clang and its libFuzzer runtime (Debian clang and libclang-rt-dev; scripts/dev.sh setup)" >&2
  [ "$smoke" = yes ] && exit 77
  exit 1
fi

cmake -S "$root" -B "$build" -DWSYNC_FUZZ=ON -DWSYNC_CUDA=OFF \
  -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target wsync_fuzz -j "$jobs"

fuzzer="$build/wsync_fuzz"
mkdir -p "$build/findings" "$build/tmp"
export TMPDIR="$build/tmp" # the entry's recipe files; the fuzzer's own
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1}" # (no leak checks: see fuzz_wsync.c)
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
options=(
  -dict="$root/tests/fuzz/wsync.dict"
  -max_len=65536
  -timeout=30
  -rss_limit_mb=4096
  -artifact_prefix="$build/findings/"
  -print_final_stats=1
)
seeds=("$root/tests/fuzz/corpus" "$root/tests/fuzz/regressions")

if [ "$smoke" = yes ]; then
  start=$(date +%s)
  scratch=$(mktemp -d "$build/tmp/smoke-corpus-XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  # Every committed input once (a regression that comes back fails here),
  # then fuzzing from them; findings fail the test and are named.
  status=0
  rm -f "$build/smoke-replay.log" "$build/smoke.log"
  "$fuzzer" "${options[@]}" -runs=0 "${seeds[@]}" 2>"$build/smoke-replay.log" || status=$?
  if [ "$status" -eq 0 ]; then
    "$fuzzer" "${options[@]}" -max_total_time="$seconds" "$scratch" "${seeds[@]}" \
      2>"$build/smoke.log" || status=$?
  fi
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$build/smoke-replay.log" "$build/smoke.log" 2>/dev/null >&2 || true
    echo "fuzz: FAILED (exit $status); findings in $build/findings/, logs $build/smoke-replay.log, $build/smoke.log" >&2
    exit 1
  fi
  grep -E '^stat::number_of_executed_units|^#[0-9]+.*DONE' "$build/smoke.log" | tail -n 2 || true
  echo "fuzz: smoke passed in $(($(date +%s) - start)) s (${seconds} s of fuzzing, corpus $(ls "${seeds[0]}" | wc -l) seeds + $(ls "${seeds[1]}" | wc -l) regressions)"
  exit 0
fi

mkdir -p "$build/corpus"
cd "$build" # -fork writes its logs here
extra=()
[ -n "$seconds" ] && extra+=(-max_total_time="$seconds")
[ "${WSYNC_FUZZ_JOBS:-1}" -gt 1 ] && extra+=(-fork="$WSYNC_FUZZ_JOBS" -ignore_crashes=1)
echo "fuzz: corpus $build/corpus, findings $build/findings/ (Ctrl-C stops)"
exec "$fuzzer" "${options[@]}" "${extra[@]}" "$build/corpus" "${seeds[@]}"
