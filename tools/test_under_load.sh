#!/usr/bin/env bash
# Run the test suite several times in a row while another process keeps one CPU core busy.
#
#   tools/test_under_load.sh                 # `make test`, 5 runs
#   tools/test_under_load.sh -n 3            # 3 runs
#   tools/test_under_load.sh -- .venv/bin/python -m pytest -q tests/unit   # any command
#
# RUNS=N in the environment sets the default count as well. A suite that passes here does not
# depend on how the scheduler treats it: on a 2-core machine the busy loop takes one core away.
# Exits with the failing run's exit code at the first failure, naming the run; 0 when all pass.
set -u

runs="${RUNS:-5}"
while [ $# -gt 0 ]; do
    case "$1" in
        -n|--runs) runs="${2:?-n needs a number}"; shift 2 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; break ;;
        *) break ;;
    esac
done
case "$runs" in
    ''|*[!0-9]*|0) echo "test_under_load: the number of runs must be a positive integer, got '$runs'" >&2; exit 2 ;;
esac
if [ $# -eq 0 ]; then
    set -- make test
fi

# One busy loop: a second process competing for the CPU for as long as the runs last.
bash -c 'while :; do :; done' &
load_pid=$!
stop_load() {
    if kill -0 "$load_pid" 2>/dev/null; then
        kill "$load_pid" 2>/dev/null
        wait "$load_pid" 2>/dev/null
    fi
}
trap stop_load EXIT
trap 'exit 130' INT TERM

echo "test_under_load: $runs run(s) of '$*' beside a busy loop (pid $load_pid)"
for run in $(seq 1 "$runs"); do
    echo "test_under_load: run $run/$runs"
    "$@"
    code=$?
    if [ "$code" -ne 0 ]; then
        echo "test_under_load: run $run/$runs FAILED (exit code $code): $*" >&2
        exit "$code"
    fi
done
echo "test_under_load: all $runs run(s) passed under load"
