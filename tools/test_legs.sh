#!/usr/bin/env bash
# `make test`'s legs, two at a time on a 2-core machine; exits non-zero when any leg fails, naming it.
#
# Most integration tests wait (on subprocesses in verl's environment, Ray, sockets, a browser), so
# one pytest process keeps about one core busy. Two legs run side by side, each its own pytest
# process with its own temporary directories:
#   ray  - every test that starts Ray or TransferQueue (pipelines on Ray, tq, cluster, verl_real) and verl_env, one
#          after another, so that two Ray clusters never start at once, then TRL's trainer runs (trl)
#          and the user-path benchmark's smoke runs, which balance the two legs' time; its output is
#          shown live;
#   rest - mypy, the docs site built strictly (mkdocs.yml), the other integration tests, tests/unit,
#          then tests/unit under verl's tensordict 0.10 (when UNIT_TD010 is set); its output is shown
#          when the ray leg is done.
# The suite passes on a loaded machine by design (tools/test_under_load.sh checks it): a leg is
# the other's load. Environment: PY (the main venv's python), VERL_PY (verl's, or empty),
# UNIT_TD010 (the tensordict-0.10 command line, or empty).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export STEPSKIP_VERL_PYTHON=${VERL_PY:-}
# (the pipelines that run in one process, colocated, match and the demo cache, go with the rest)
RAY_TESTS=(tests/integration/pipelines/test_ray_pipelines.py tests/integration/pipelines/test_v1.py
           tests/integration/pipelines/test_compare_pipelines.py tests/integration/pipelines/test_command_line.py
           tests/integration/tq tests/integration/cluster tests/integration/verl_real tests/integration/verl_env
           tests/integration/trl tests/integration/benchmarks/test_bench_user_path.py)
# the rest as one tree with the Ray directories left out: collected directory by directory, as a
# whole-suite run does
REST_TESTS=(tests/integration)
for dir in "${RAY_TESTS[@]}"; do REST_TESTS+=("--ignore=$dir"); done

rest_log=$(mktemp -t stepskip-rest-leg.XXXXXX)
rest_failed="$rest_log.failed"
(
    failed=()
    "$PY" -m mypy || failed+=(mypy)
    docs_site=$(mktemp -d -t stepskip-docs-site.XXXXXX)
    NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir "$docs_site" || failed+=("docs (mkdocs build --strict)")
    rm -rf "$docs_site"
    "$PY" -m pytest -q -p no:cacheprovider --durations=10 "${REST_TESTS[@]}" || failed+=("tests/integration (without Ray)")
    "$PY" -m pytest -q -p no:cacheprovider tests/unit || failed+=(tests/unit)
    if [ -n "${UNIT_TD010:-}" ]; then
        bash -c "$UNIT_TD010" || failed+=("tests/unit under tensordict 0.10")
    fi
    printf '%s\n' "${failed[@]}" > "$rest_failed"
) > "$rest_log" 2>&1 &
rest=$!
trap 'kill -- -$rest 2>/dev/null; kill $rest 2>/dev/null' INT TERM

echo "== leg ray: ${RAY_TESTS[*]} (the other leg runs beside it; its output follows)"
"$PY" -m pytest -q --durations=15 "${RAY_TESTS[@]}"
ray_status=$?
wait $rest
echo "== leg rest: mypy, docs, tests/integration ${REST_TESTS[*]:1}, tests/unit${UNIT_TD010:+, tests/unit under tensordict 0.10}"
cat "$rest_log"

failed=()
[ $ray_status -eq 0 ] || failed+=("tests/integration with Ray")
if [ -f "$rest_failed" ]; then
    while IFS= read -r leg; do [ -n "$leg" ] && failed+=("$leg"); done < "$rest_failed"
else
    failed+=("the rest leg (it did not finish)")
fi
rm -f "$rest_log" "$rest_failed"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'make test: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "make test: every leg passed"
