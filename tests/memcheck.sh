#!/usr/bin/env bash
# Runs the wsync binary under valgrind memcheck over the host foundation's
# paths: a -e chunk, the smoke recipe, `check` on a broken recipe, a REPL
# session over a pipe, and the CPU test tiers (unit and bindings) inside the
# host. Any memcheck error, any definite leak, a wrong exit code or a
# shared-memory segment left behind fails the run.
#
# usage: tests/memcheck.sh PATH/TO/wsync      (CTest: the `memcheck` tier)
# Logs go to a temporary directory, removed when every check passes and named
# in the summary when one fails; WSYNC_MEMCHECK_LOGS=DIR keeps them in DIR.
set -u

if [ $# -ne 1 ]; then
  echo "usage: $0 PATH/TO/wsync" >&2
  exit 2
fi
wsync=$(realpath "$1")
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2

if ! command -v valgrind >/dev/null 2>&1; then
  echo "memcheck: valgrind is not installed (Debian package valgrind)" >&2
  exit 1
fi
if [ ! -x "$wsync" ]; then
  echo "memcheck: $wsync is not an executable" >&2
  exit 1
fi

keep_logs=${WSYNC_MEMCHECK_LOGS:+yes}
logs=${WSYNC_MEMCHECK_LOGS:-$(mktemp -d /tmp/wsync-memcheck-XXXXXX)}
mkdir -p "$logs"
# Children that the test tiers spawn run natively; point them at this binary.
export WSYNC_BIN="$wsync"

valgrind_args=(
  --tool=memcheck
  --leak-check=full
  --errors-for-leak-kinds=definite
  --error-exitcode=99
  --num-callers=40
  --suppressions="$root/tests/valgrind.supp"
)

failures=0
summary=()
started_all=$SECONDS

# check NAME EXPECTED_EXIT STDIN_TEXT ARGS...
# EXPECTED_EXIT is a number, or "any" (any exit without a signal, except
# valgrind's 99). STDIN_TEXT reaches wsync through a pipe from printf '%b';
# empty means stdin is /dev/null.
check() {
  local name=$1 expected=$2 input=$3
  shift 3
  local log="$logs/$name.valgrind.log" output="$logs/$name.output"
  local started=$SECONDS code
  if [ -n "$input" ]; then
    printf '%b' "$input" |
      valgrind "${valgrind_args[@]}" --log-file="$log" "$wsync" "$@" >"$output" 2>&1
    code=${PIPESTATUS[1]}
  else
    valgrind "${valgrind_args[@]}" --log-file="$log" "$wsync" "$@" \
      </dev/null >"$output" 2>&1
    code=$?
  fi
  local seconds=$((SECONDS - started))
  # The process id that named wsync's segments is the one valgrind logs.
  local pid
  pid=$(sed -n '1s/^==\([0-9][0-9]*\)==.*/\1/p' "$log")

  local problems=()
  local errors lost
  errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9][0-9]*\) errors.*/\1/p' "$log" | tail -n 1)
  lost=$(sed -n 's/.*definitely lost: \([0-9,][0-9,]*\) bytes.*/\1/p' "$log" | tail -n 1 | tr -d ,)
  if [ -z "$errors" ]; then
    problems+=("valgrind wrote no error summary")
    errors="?"
  elif [ "$errors" != 0 ]; then
    problems+=("$errors memcheck errors")
  fi
  lost=${lost:-0}
  if [ "$lost" != 0 ]; then
    problems+=("$lost bytes definitely lost")
  fi
  if [ "$code" = 99 ]; then
    problems+=("valgrind's error exit code")
  elif [ "$expected" = any ]; then
    if [ "$code" -ge 128 ]; then
      problems+=("killed by signal $((code - 128))")
    fi
  elif [ "$code" != "$expected" ]; then
    problems+=("exit $code, expected $expected")
  fi
  local leftover=""
  if [ -n "$pid" ]; then
    leftover=$(find /dev/shm -maxdepth 1 -name "wsync-$pid-*" 2>/dev/null)
  fi
  if [ -n "$leftover" ]; then
    problems+=("shared memory left behind: $(echo $leftover)")
    rm -f $leftover
  fi

  local verdict=ok
  if [ ${#problems[@]} -gt 0 ]; then
    verdict="FAILED: $(printf '%s; ' "${problems[@]}")"
    verdict=${verdict%; }
    failures=$((failures + 1))
    echo "---- $name: wsync $* ($verdict)"
    echo "---- output ($output):"
    tail -n 40 "$output"
    echo "---- valgrind ($log):"
    grep -v '^==[0-9]*== *$' "$log" | tail -n 80
    echo "----"
  fi
  summary+=("$(printf '%-12s exit %-3s errors %-3s definitely lost %-6s %4ss  %s' \
    "$name" "$code" "$errors" "$lost" "$seconds" "$verdict")")
}

check eval 0 "" -e 'local m = require("wsync.native.manifest").of({{"w", "bfloat16", {2, 3}}}) print(m.digest)'
check smoke 0 "" run recipes/smoke.lua
check check-broken 3 "" check tests/fixtures/recipes/bad_param.lua
check repl any '1+1\nerror("x")\n' repl
check tiers 0 "" test tests/unit tests/bindings

echo "memcheck summary (valgrind $(valgrind --version | sed 's/^valgrind-//')):"
printf '  %s\n' "${summary[@]}"
total=$((SECONDS - started_all))
if [ "$failures" -gt 0 ]; then
  echo "memcheck: $failures of ${#summary[@]} checks FAILED in ${total}s (logs in $logs)"
  exit 1
fi
echo "memcheck: all ${#summary[@]} checks passed in ${total}s"
if [ -z "$keep_logs" ]; then
  rm -rf "$logs"
else
  echo "memcheck: logs in $logs"
fi
exit 0
