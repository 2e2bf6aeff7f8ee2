#!/usr/bin/env bash
# The default test suite: unit + flow tests and the lab's tests (pyproject.toml testpaths: tests, lab/tests) on CPU
# (slow end-to-end and GPU tests are deselected).
# Extra arguments go to pytest. Slow suite: ./scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# PostgreSQL for the tests marked postgres (a few flow tests run on it): installed here when missing (root, Debian);
# where it cannot be, those tests fail saying so.
./scripts/postgres.sh install || echo "test.sh: no PostgreSQL; the tests marked postgres will fail" >&2
# Test files run on parallel workers (pytest-xdist; a file's tests stay on one worker, so its module fixtures are
# built once): 2 workers on a 2-core machine took the default suite from 14.1 to 7.6 minutes. EAGLE3_TEST_WORKERS
# sets their number (0: no workers); each gets an equal share of the cores for its torch threads.
cores=$(nproc)
workers=${EAGLE3_TEST_WORKERS:-$(( cores < 2 ? 1 : (cores < 8 ? cores : 8) ))}
threads=$(( workers > 1 ? cores / workers : cores ))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
select=(-m "not slow and not gpu")
for arg in "$@"; do [ "$arg" = "-m" ] && select=(); done
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest "${select[@]}" "${parallel[@]}" "$@"
