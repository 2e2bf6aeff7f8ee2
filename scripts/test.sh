#!/usr/bin/env bash
# The default test suite: unit + flow tests on CPU (slow end-to-end and GPU tests are deselected).
# Extra arguments go to pytest. Slow suite: ./scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# PostgreSQL for the tests marked postgres (a few flow tests run on it): installed here when missing (root, Debian);
# where it cannot be, those tests fail saying so.
./scripts/postgres.sh install || echo "test.sh: no PostgreSQL; the tests marked postgres will fail" >&2
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
select=(-m "not slow and not gpu")
for arg in "$@"; do [ "$arg" = "-m" ] && select=(); done
exec .venv/bin/python -m pytest "${select[@]}" "$@"
