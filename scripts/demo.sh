#!/usr/bin/env bash
# The main job: the demo pipeline on the embedded defaults (local Prefect server on SQLite under
# runs/.prefect, SmolLM2-135M-Instruct, bundled ShareGPT data). Extra arguments go to `eagle3 demo`,
# e.g. ./scripts/demo.sh --set data.sources.0.max_records=10000
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/eagle3 demo "$@"
